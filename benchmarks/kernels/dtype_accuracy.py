"""Measured accuracy of running the model in bfloat16 instead of float32 (weights and
activations, as `--dtype bfloat16` does).

Teacher-forced: six fixed passages (prose, code, a list, a chat exchange in the model's chat
template, science, a dialogue) go through loom's own model (`DecoderModel.forward` over the
flat batch, as the engine's prefill runs it, then `compute_logits`) in both dtypes; over
every position it reports top-1 agreement, mean and max KL(fp32 || bf16) of the next-token
distributions, and the perplexity of the passage under each dtype.

Free-running: greedy completions (temperature 0, up to 64 tokens, stopping at EOS) of ten
prompts through `LLM.generate` in both dtypes, all ten in one batch; it reports how many are
token-for-token identical and the mean length of the common prefix, and as a noise floor the
same for fp32 run one prompt at a time vs fp32 batched (batch shape alone changes rounding).
Run from the repository root:

    python benchmarks/kernels/dtype_accuracy.py            # a few minutes on 2 cores
    python benchmarks/kernels/dtype_accuracy.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import loom  # noqa: F401 - before torch: it sets the OpenMP wait policy (loom/threads.py)

# isort: split
import torch

from loom import LLM, SamplingParams
from loom.model.attention import AttentionMetadata, PrefillSpan, new_kv_cache
from loom.model.decoder import DecoderModel
from loom.model.tokenizer import Tokenizer

DTYPES = ("float32", "bfloat16")
BLOCK_SIZE = 16

PROSE = (
    "The lighthouse keeper had not spoken to another person in eleven days when the supply "
    "boat finally rounded the northern point. He watched it from the gallery, one hand on the "
    "cold iron rail, counting the seconds between the swells as his father had taught him. The "
    "sea was grey and restless, and the boat rose and fell like a cork in a basin. When it "
    "reached the landing, a young woman in a yellow oilskin jumped onto the rocks before the "
    "pilot had even thrown the rope. She carried a canvas bag over one shoulder and a wooden "
    "crate under her arm, and she climbed the steps two at a time. 'You must be Mr. Harlow,' "
    "she said, out of breath, when she reached the door. 'The harbour office sent me. They "
    "said the light has been failing at night and nobody believes your reports anymore.' He "
    "looked at her for a long moment, then at the crate, which was stamped with the seal of "
    "the Royal Observatory. 'Then they have finally sent someone who can read a chart,' he "
    "said, and stepped aside to let her in out of the wind."
)

CODE = '''import json
from dataclasses import dataclass, field


@dataclass
class Inventory:
    """A small in-memory inventory of items and their quantities."""

    items: dict[str, int] = field(default_factory=dict)

    def add(self, name: str, quantity: int = 1) -> None:
        if quantity <= 0:
            raise ValueError("quantity must be positive")
        self.items[name] = self.items.get(name, 0) + quantity

    def remove(self, name: str, quantity: int = 1) -> bool:
        """Remove up to `quantity` of an item; return False if there was not enough."""
        current = self.items.get(name, 0)
        if current < quantity:
            return False
        if current == quantity:
            del self.items[name]
        else:
            self.items[name] = current - quantity
        return True

    def total(self) -> int:
        return sum(self.items.values())

    def to_json(self) -> str:
        return json.dumps(self.items, sort_keys=True)


if __name__ == "__main__":
    inventory = Inventory()
    inventory.add("apple", 3)
    inventory.add("pear")
    print(inventory.total(), inventory.to_json())
'''

LIST = (
    "Packing list for a three-day hiking trip in the mountains:\n\n"
    "1. Backpack (40 to 50 litres) with a rain cover\n"
    "2. Lightweight tent, sleeping bag rated to 0 degrees Celsius, and a sleeping pad\n"
    "3. Stove, one gas canister, a lighter, and a small pot\n"
    "4. Food: oatmeal, dried fruit, nuts, pasta, cheese, and chocolate\n"
    "5. Water filter and two one-litre bottles\n"
    "6. Clothing: base layers, a fleece jacket, a waterproof shell, a warm hat, and gloves\n"
    "7. Hiking boots that are already broken in, plus two pairs of wool socks\n"
    "8. Map, compass, and a fully charged phone with offline maps\n"
    "9. First aid kit: bandages, blister plasters, pain relief, and any personal medication\n"
    "10. Headlamp with spare batteries\n"
    "11. Sunscreen, sunglasses, and lip balm\n"
    "12. A small trowel and biodegradable toilet paper\n\n"
    "Before leaving, check the weather forecast, tell someone your route and the time you "
    "expect to return, and make sure the trail is open."
)

CHAT = [
    {"role": "user", "content": "Can you explain what photosynthesis is in simple terms?"},
    {"role": "assistant", "content": (
        "Photosynthesis is the process plants use to make their own food. They take in "
        "sunlight through their leaves, water through their roots, and carbon dioxide from "
        "the air. Using the energy of the light, they turn the water and carbon dioxide into "
        "sugar, which they use to grow, and they release oxygen as a by-product. That oxygen "
        "is what we and most other animals breathe.")},
    {"role": "user", "content": "Why are most leaves green?"},
    {"role": "assistant", "content": (
        "Leaves are green because of a pigment called chlorophyll, which captures the light "
        "used in photosynthesis. Chlorophyll absorbs mostly red and blue light and reflects "
        "green light, so green is the colour that reaches our eyes. In autumn, many trees stop "
        "making chlorophyll, and the yellow and orange pigments that were hidden underneath "
        "become visible.")},
]

SCIENCE = (
    "The water cycle describes how water moves between the oceans, the atmosphere, and the "
    "land. Heat from the sun causes water to evaporate from the surface of oceans, lakes, and "
    "rivers, and plants release water vapour through their leaves in a process called "
    "transpiration. As the warm, moist air rises, it cools, and the water vapour condenses "
    "into tiny droplets that form clouds. When the droplets combine and grow heavy enough, "
    "they fall back to the ground as precipitation: rain, snow, sleet, or hail. Some of this "
    "water flows over the land as runoff and returns to the sea through rivers, while some "
    "soaks into the soil and becomes groundwater, which can remain underground for thousands "
    "of years. The cycle has no beginning or end, and the total amount of water on Earth "
    "stays almost constant. Changes in temperature, however, can speed up or slow down each "
    "stage, which is why a warmer climate tends to bring both heavier rainfall and longer "
    "droughts."
)

DIALOGUE = (
    "Customer: Hi, I ordered a pair of running shoes last week, but they arrived in the wrong "
    "size. I ordered a size nine and received a size eleven.\n"
    "Agent: I'm sorry about that. Could you give me your order number, please?\n"
    "Customer: Sure, it's 48213.\n"
    "Agent: Thank you. I can see the order here. It looks like there was a mistake at our "
    "warehouse. I can send you a replacement pair in size nine today, and I'll email you a "
    "prepaid label so you can return the other pair for free.\n"
    "Customer: That would be great. How long will the new pair take to arrive?\n"
    "Agent: With express shipping, which we'll cover, it should arrive in two to three "
    "business days. Is the delivery address still the same?\n"
    "Customer: Yes, it is. Thank you for sorting this out so quickly.\n"
    "Agent: You're welcome. Is there anything else I can help you with today?\n"
    "Customer: No, that's everything. Have a nice day!"
)

PASSAGES: dict[str, str | list[dict[str, str]]] = {
    "prose": PROSE, "code": CODE, "list": LIST, "chat": CHAT, "science": SCIENCE,
    "dialogue": DIALOGUE,
}

PROMPTS: list[str | list[dict[str, str]]] = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a village at the edge of a great forest,",
    "The three primary colours are",
    "Here is a list of tips for staying productive while working from home:\n1.",
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "user", "content": "Explain in two sentences why the sky is blue."}],
    [{"role": "user", "content": "Give me three ideas for a healthy breakfast."}],
    [{"role": "user", "content": "How do I reverse a list in Python?"}],
]


def encode(tokenizer: Tokenizer, item: str | list[dict[str, str]], generation: bool) -> list[int]:
    """A plain text, or a conversation through the model's chat template."""
    if isinstance(item, str):
        return tokenizer.encode(item)
    text = tokenizer.apply_chat_template(item, add_generation_prompt=generation)
    return tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def passage_logits(model: DecoderModel, token_ids: list[int],
                   kv_dtype: torch.dtype | None = None, prefill_bf16: bool = False
                   ) -> torch.Tensor:
    """[n, vocab] fp32 logits of every position, from one prefill of the whole passage into a
    fresh paged KV cache of kv_dtype (default: the model's; the path the engine's prefill
    takes), its attention in bf16 if prefill_bf16 and the passage is long enough
    (AttentionMetadata.prefill_bf16)."""
    arch, n = model.arch, len(token_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    caches = [new_kv_cache(num_blocks, BLOCK_SIZE, arch.num_kv_heads, arch.head_dim,
                           kv_dtype or model.dtype, torch.device("cpu"))
              for _ in range(arch.num_layers)]
    positions = torch.arange(n)
    slots = (positions // BLOCK_SIZE, positions % BLOCK_SIZE)
    meta = AttentionMetadata(slots=slots, decodes=[], prefills=[PrefillSpan(
        query_start=0, query_len=n, context_len=n, block_ids=torch.arange(num_blocks))],
        prefill_bf16=prefill_bf16)
    hidden = model.forward(torch.tensor(token_ids), positions, caches, meta)
    return model.compute_logits(hidden).float()


def compare_logits(ref: torch.Tensor, test: torch.Tensor, token_ids: list[int]
                   ) -> dict[str, Any]:
    """Position i's logits predict token i + 1: compare those n - 1 distributions."""
    ref_lp = ref[:-1].log_softmax(-1)
    test_lp = test[:-1].log_softmax(-1)
    targets = torch.tensor(token_ids[1:]).unsqueeze(1)
    kl = (ref_lp.exp() * (ref_lp - test_lp)).sum(-1).clamp_min(0)
    return {
        "positions": len(token_ids) - 1,
        "top1_agree": int((ref_lp.argmax(-1) == test_lp.argmax(-1)).sum()),
        "kl_sum": float(kl.sum()), "kl_max": float(kl.max()),
        "nll_ref": float(-ref_lp.gather(1, targets).sum()),
        "nll_test": float(-test_lp.gather(1, targets).sum()),
    }


def teacher_forced(llms: dict[str, LLM], passages: dict[str, Any]) -> list[dict[str, Any]]:
    tokenizer = llms["float32"].tokenizer
    rows = []
    for name, passage in passages.items():
        ids = encode(tokenizer, passage, generation=False)
        logits = {d: passage_logits(llms[d].engine.runner.model, ids) for d in DTYPES}
        rows.append({"passage": name, "tokens": len(ids),
                     **compare_logits(logits["float32"], logits["bfloat16"], ids)})
    total = {"passage": "all", "tokens": sum(r["tokens"] for r in rows)}
    for key in ("positions", "top1_agree", "kl_sum", "nll_ref", "nll_test"):
        total[key] = sum(r[key] for r in rows)
    total["kl_max"] = max(r["kl_max"] for r in rows)
    return [*rows, total]


def free_running(llms: dict[str, LLM], prompts: list[Any], max_tokens: int
                 ) -> list[dict[str, Any]]:
    tokenizer = llms["float32"].tokenizer
    ids = [encode(tokenizer, p, generation=True) for p in prompts]
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    outs = {d: [o.outputs[0].token_ids for o in llms[d].generate(ids, params)] for d in DTYPES}
    # Noise floor: the same fp32 engine, one prompt at a time instead of all in one batch.
    alone = [llms["float32"].generate(i, params)[0].outputs[0].token_ids for i in ids]
    rows = []
    for prompt, a, b, c in zip(prompts, outs["float32"], outs["bfloat16"], alone):
        label = prompt if isinstance(prompt, str) else "chat: " + prompt[-1]["content"]
        rows.append({"prompt": label, "len_fp32": len(a), "len_bf16": len(b),
                     "common_prefix": _common_prefix(a, b), "identical": a == b,
                     "fp32_alone_common_prefix": _common_prefix(a, c),
                     "fp32_alone_identical": a == c,
                     "text_fp32": tokenizer.decode(a), "text_bf16": tokenizer.decode(b)})
    return rows


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def print_report(tf: list[dict[str, Any]], fr: list[dict[str, Any]], max_tokens: int) -> None:
    print("\n## Teacher-forced: bfloat16 vs float32 next-token distributions\n")
    print("| passage | tokens | top-1 agree | mean KL | max KL | ppl fp32 | ppl bf16 "
          "| ppl change |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in tf:
        n = r["positions"]
        ppl_ref, ppl_test = math.exp(r["nll_ref"] / n), math.exp(r["nll_test"] / n)
        name = f"**{r['passage']}**" if r["passage"] == "all" else r["passage"]
        print(f"| {name} | {r['tokens']} | {100 * r['top1_agree'] / n:.1f}% "
              f"| {r['kl_sum'] / n:.5f} | {r['kl_max']:.4f} | {ppl_ref:.3f} | {ppl_test:.3f} "
              f"| {100 * (ppl_test / ppl_ref - 1):+.2f}% |")
    print("\nKL(fp32 || bf16) in nats per position; top-1 agree: the argmax next token is the "
          "same in both dtypes.")
    print(f"\n## Free-running: greedy completions, up to {max_tokens} tokens\n")
    print("| prompt | fp32 tokens | bf16 tokens | common prefix | identical |")
    print("|---|---:|---:|---:|:---:|")
    for r in fr:
        label = r["prompt"].replace("\n", "\\n").replace("|", "\\|")[:48]
        print(f"| {label} | {r['len_fp32']} | {r['len_bf16']} | {r['common_prefix']} "
              f"| {'yes' if r['identical'] else 'no'} |")
    same = sum(r["identical"] for r in fr)
    mean_prefix = sum(r["common_prefix"] for r in fr) / len(fr)
    mean_len = sum(r["len_fp32"] for r in fr) / len(fr)
    print(f"\nidentical completions: {same}/{len(fr)}; mean common prefix {mean_prefix:.1f} "
          f"tokens (mean fp32 completion {mean_len:.1f} tokens)")
    alone_same = sum(r["fp32_alone_identical"] for r in fr)
    alone_prefix = sum(r["fp32_alone_common_prefix"] for r in fr) / len(fr)
    print(f"noise floor, fp32 one prompt at a time vs fp32 batched: {alone_same}/{len(fr)} "
          f"identical, mean common prefix {alone_prefix:.1f} tokens")
    for r in fr:
        if not r["identical"]:
            print(f"\n- {r['prompt']!r} diverges after {r['common_prefix']} tokens:\n"
                  f"  fp32: {r['text_fp32']!r}\n  bf16: {r['text_bf16']!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="two passages, three prompts, 16 tokens: a smoke run")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="greedy tokens per prompt (default 64; quick: 16)")
    parser.add_argument("--out", help="also write every figure to this JSON file")
    args = parser.parse_args()
    max_tokens = args.max_tokens or (16 if args.quick else 64)
    passages = dict(list(PASSAGES.items())[:2]) if args.quick else PASSAGES
    prompts = PROMPTS[:2] + PROMPTS[5:6] if args.quick else PROMPTS
    llms = {d: LLM(dtype=d, kv_cache_memory="128MiB") for d in DTYPES}
    tf = teacher_forced(llms, passages)
    fr = free_running(llms, prompts, max_tokens)
    print_report(tf, fr, max_tokens)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"teacher_forced": tf, "free_running": fr, "max_tokens": max_tokens}, f,
                      indent=2)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
