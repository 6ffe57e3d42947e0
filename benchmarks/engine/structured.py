"""Structured outputs: what the grammar engines cost on this CPU, and what constraining costs
the engine.

    python benchmarks/engine/structured.py backends     # llguidance vs xgrammar (if importable)
    python benchmarks/engine/structured.py throughput   # C = 32, 0 / 25 / 100 % constrained
    python benchmarks/engine/structured.py apply        # ways to apply a bitmask to 32 rows

`backends` walks both engines' matchers along the same JSON answer (the bundled SmolLM2
tokenizer, one nested schema): the compile time, and the time to compute one token's mask
and advance by it, at batch 1 and 32 (32 matchers stepping together, as 32 constrained
requests in one decode step). xgrammar is optional: install it into a throwaway target
(`pip install --no-deps --target DIR xgrammar==0.2.9 apache-tvm-ffi`, then PYTHONPATH=DIR).

`throughput` runs 32 requests at once on the offline engine, greedy, each running to
max_tokens (the schema's array is long enough that no constrained answer can end first), and
reports output tokens/s and the engine's mask time per step, 0 %, 25 % and 100 % constrained,
interleaved, in alternating order from round to round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.harness import host_line, round_order, timings  # noqa: E402
from loom import LLM, SamplingParams  # noqa: E402
from loom.model.arch import default_model_path  # noqa: E402
from loom.model.loader import load_model  # noqa: E402
from loom.sampling import StructuredOutputsParams  # noqa: E402
from loom.structured.grammar import JSON_OPTIONS  # noqa: E402

ITEM = {"type": "object", "additionalProperties": False, "required": ["name", "qty", "unit"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                       "unit": {"enum": ["g", "kg", "ml", "l", "pcs"]}}}
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["recipe", "items"],
          "properties": {"recipe": {"type": "string", "maxLength": 24},
                         "items": {"type": "array", "items": ITEM, "minItems": 64}}}
ANSWER = json.dumps({"recipe": "pancakes", "items": [
    {"name": f"thing {i}", "qty": 10 * i, "unit": "g"} for i in range(64)]})
PROMPT = "List the ingredients of pancakes as JSON."


# -- grammar engines ---------------------------------------------------------------------------


def _llguidance(tokenizer: Any, vocab: int) -> tuple[float, Any]:
    import llguidance
    import llguidance.numpy as lln

    start = time.perf_counter()
    lltok = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab,
                                   eos_token=tokenizer.eos_token_ids)
    tok_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA, defaults=JSON_OPTIONS)

    def make() -> Any:
        return llguidance.LLMatcher(lltok, grammar, log_level=0)

    def step(matchers: list[Any], bitmask: np.ndarray, token: int) -> None:
        for row, m in enumerate(matchers):
            lln.fill_next_token_bitmask(m, bitmask, row)
        for m in matchers:
            assert m.consume_token(token)

    return tok_s, (make, step, lambda n: lln.allocate_token_bitmask(n, vocab))


def _xgrammar(tokenizer: Any, vocab: int) -> tuple[float, Any]:
    import xgrammar as xgr

    backend = tokenizer.backend
    start = time.perf_counter()
    encoded = [backend.id_to_token(i) for i in range(vocab)]
    info = xgr.TokenizerInfo(encoded, vocab_type=xgr.VocabType.BYTE_LEVEL, vocab_size=vocab,
                             stop_token_ids=tokenizer.eos_token_ids)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    tok_s = time.perf_counter() - start

    def make() -> Any:
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                separators=(", ", ": "))
        return xgr.GrammarMatcher(compiled)

    def step(matchers: list[Any], bitmask: Any, token: int) -> None:
        for row, m in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, row)
        for m in matchers:
            assert m.accept_token(token)

    return tok_s, (make, step, lambda n: xgr.allocate_token_bitmask(n, vocab))


def backends(args: argparse.Namespace) -> None:
    loaded = load_model(default_model_path())
    tokenizer, vocab = loaded.tokenizer, loaded.arch.vocab_size
    answer = tokenizer.encode(ANSWER, add_special_tokens=False)
    rows = []
    for name, build in (("llguidance", _llguidance), ("xgrammar", _xgrammar)):
        try:
            tok_s, (make, step, alloc) = build(tokenizer, vocab)
        except ImportError as e:
            print(f"{name}: not importable ({e}); skipped")
            continue
        start = time.perf_counter()
        make()
        compile_ms = (time.perf_counter() - start) * 1e3
        for batch in (1, 32):
            per_token = []
            for _ in range(args.rounds):
                matchers, bitmask = [make() for _ in range(batch)], alloc(batch)
                start = time.perf_counter()
                for token in answer:
                    step(matchers, bitmask, token)
                per_token.append((time.perf_counter() - start) / len(answer))
            rows.append((name, tok_s, compile_ms, batch, statistics.median(per_token) * 1e6))
    print(f"\n{host_line()}; {len(answer)} answer tokens, "
          f"median of {args.rounds}")
    print("| engine | tokenizer set-up | schema compile | batch | mask + advance per token "
          "(all rows) |\n|---|---|---|---|---|")
    for name, tok_s, compile_ms, batch, us in rows:
        print(f"| {name} | {tok_s:.2f} s | {compile_ms:.1f} ms | {batch} | {us:.0f} us |")


# -- the engine ----------------------------------------------------------------------------------


def throughput(args: argparse.Namespace) -> None:
    llm = LLM(kv_cache_memory="1GiB", max_model_len=2048, max_num_seqs=32)
    core = llm.engine
    mask = {"seconds": 0.0, "steps": 0}
    fill = core.structured.fill_bitmask

    def timed_fill(states: list[Any]) -> Any:
        start = time.perf_counter()
        try:
            return fill(states)
        finally:
            mask["seconds"] += time.perf_counter() - start
            mask["steps"] += 1

    core.structured.fill_bitmask = timed_fill
    constrained = StructuredOutputsParams(json=SCHEMA)
    prompt = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}]), add_special_tokens=False)
    results: dict[int, list[tuple[float, float, float]]] = {0: [], 25: [], 100: []}
    llm.generate([prompt], SamplingParams(max_tokens=4, structured_outputs=constrained))  # warm
    for round_ in range(args.rounds):  # the order alternates, so drift favours no share
        for share in round_order((0, 25, 100), round_):
            n_constrained = args.concurrency * share // 100
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True,
                                     structured_outputs=constrained if i < n_constrained
                                     else None)
                      for i in range(args.concurrency)]
            mask.update(seconds=0.0, steps=0)
            start = time.perf_counter()
            outs = llm.generate([prompt] * args.concurrency, params)
            elapsed = time.perf_counter() - start
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == args.concurrency * args.max_tokens, "a request ended early"
            results.setdefault(share, []).append((
                tokens / elapsed, mask["seconds"] / max(mask["steps"], 1) * 1e3,
                mask["seconds"] / elapsed))
            print(f"round {round_}: {share} % constrained: {tokens / elapsed:.1f} tok/s")
    base = statistics.median(r[0] for r in results[0])
    print(f"\n{host_line()}; C = {args.concurrency}, "
          f"{args.max_tokens} tokens each, median of {args.rounds}")
    print("| constrained | output tok/s | vs unconstrained | mask fill per step | share of "
          "wall time |\n|---|---|---|---|---|")
    for share, runs in results.items():
        rate = statistics.median(r[0] for r in runs)
        fill_ms = statistics.median(r[1] for r in runs)
        wall = statistics.median(r[2] for r in runs)
        print(f"| {share} % | {rate:.1f} | {rate / base:.2f}x | {fill_ms:.2f} ms | "
              f"{wall:.1%} |")


def apply(args: argparse.Namespace) -> None:
    """The sampler's bitmask application against the obvious torch ones, on 32 rows of the
    bundled model's vocabulary (random masks; best of 30, single-threaded torch)."""
    import torch

    from loom.model.logits import apply_token_bitmask

    torch.set_num_threads(1)
    vocab, rows = 49152, 32
    logits = torch.randn(rows, vocab)
    bitmask = np.random.default_rng(0).integers(-2**31, 2**31 - 1, (rows, vocab // 32),
                                                dtype=np.int32)

    def torch_shifts() -> torch.Tensor:
        shifts = torch.arange(32, dtype=torch.int32)
        bits = ((torch.from_numpy(bitmask).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
        return logits.masked_fill(~bits, float("-inf"))

    def numpy_masked_fill() -> torch.Tensor:
        bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")
        return logits.masked_fill(~torch.from_numpy(bits).view(torch.bool), float("-inf"))

    ways = {"torch shifts + masked_fill": torch_shifts,
            "numpy unpack + masked_fill": numpy_masked_fill,
            "numpy unpack + bias add (loom)": lambda: apply_token_bitmask(logits, bitmask)}
    assert all(torch.equal(f(), torch_shifts()) for f in ways.values())
    best = dict.fromkeys(ways, float("inf"))
    for _ in range(30):
        for name, f in ways.items():
            best[name] = min(best[name], timings(f, 1, warmup=0)[0])
    print(f"\n{host_line()}; {rows} rows x {vocab}")
    print("| way | best of 30 |\n|---|---|")
    for name, seconds in best.items():
        print(f"| {name} | {seconds * 1e3:.2f} ms |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["backends", "throughput", "apply"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    {"backends": backends, "throughput": throughput, "apply": apply}[args.what](args)


if __name__ == "__main__":
    main()
