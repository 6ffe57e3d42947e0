"""Golden test: loom's greedy tokens for the bundled SmolLM2-135M-Instruct are transformers'
greedy continuation on the same weights (transformers loads the same GGUF) and the same prompt
token ids, both one request at a time and all requests in one continuous batch whose small token
budget forces chunked prefills and decodes into the same steps. Checked in one teacher-forced
transformers pass per answer (every token its argmax after the ones before, the answer ending
at EOS or at max_tokens): the tokens greedy `generate` would give, in one pass instead of one
per token. In float32 throughout, the KV cache included (transformers keeps its K/V in float32;
loom's default fp16 cache on CPU is measured against an fp32 one in test_dtype.py and
benchmarks/kernels/kv_dtype_accuracy.py).
"""

from __future__ import annotations

import pytest
import torch
from model_fixtures import smollm_hf_model

from loom import LLM
from loom.sampling import SamplingParams

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_torch_thread")]


MAX_TOKENS = 24
EOS = 2
LONG_TEXT = (
    "Continuous batching lets an inference server add new requests to the running batch at "
    "every iteration instead of waiting for the whole batch to finish. Combined with a paged "
    "KV cache, which stores keys and values in fixed-size blocks, it keeps the accelerator "
    "busy and avoids fragmentation. Chunked prefill splits long prompts so that decodes of "
    "other requests are not stalled. Summarize the three ideas above in one sentence:")

# (name, chat messages or plain text): chat-templated and plain, digits, code, whitespace,
# unicode, very short and long (> the batched run's 64-token budget, so it is chunked).
PROMPTS: list[tuple[str, list[dict[str, str]] | str]] = [
    ("chat-arithmetic", [{"role": "user", "content": "What is 17 * 23?"}]),
    ("chat-haiku", [{"role": "user", "content": "Write a haiku about the sea."}]),
    ("chat-system-multiturn", [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a primary color."},
        {"role": "assistant", "content": "Red is a primary color."},
        {"role": "user", "content": "Name another one, and count to 5."}]),
    ("plain-capital", "The capital of France is"),
    ("plain-code", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    "),
    ("plain-digits", "Prices: 3 apples cost $4.50, so 12 apples cost $"),
    ("plain-whitespace", "Shopping list:\n\n\t- eggs  (12)\n\t- milk   2L\n    - bread\n\n"
                         "Total items:"),
    ("plain-unicode", "Translate to French: «Good morning, my friend.» →"),
    ("plain-short", "Hi"),
    ("plain-long", LONG_TEXT),
]


def prompt_ids(tokenizer, prompt) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    return tokenizer.encode(tokenizer.apply_chat_template(prompt), add_special_tokens=False)


@pytest.fixture(scope="module")
def llm_alone():
    """Default token budget (every prompt is one prefill); no prefix caching."""
    return LLM(num_kv_blocks=64, max_model_len=1024, enable_prefix_caching=False, num_threads=1,
               dtype="float32", kv_cache_dtype="float32")


@pytest.fixture(scope="module")
def prompts(llm_alone) -> dict[str, list[int]]:
    ids = {name: prompt_ids(llm_alone.tokenizer, p) for name, p in PROMPTS}
    lengths = sorted(len(v) for v in ids.values())
    assert lengths[0] <= 3 and lengths[-1] > 64  # really mixed lengths
    return ids


def transformers_log_softmax(prompt: list[int], answer: list[int], name: str) -> torch.Tensor:
    """Assert that `answer` is transformers' greedy continuation of `prompt` (each token the
    argmax of transformers' logits after those before it; EOS, which ends the answer, only at
    its end, or none and max_tokens long); returns the log-softmax row of each answer token."""
    model = smollm_hf_model()
    assert model.generation_config.eos_token_id == EOS
    with torch.no_grad():
        logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
    assert logits.argmax(-1).tolist() == answer, name
    assert EOS not in answer[:-1] and (answer[-1] == EOS or len(answer) == MAX_TOKENS), name
    return logits.float().log_softmax(-1)


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


@pytest.mark.parametrize("name", [name for name, _ in PROMPTS])
def test_alone_matches_transformers(llm_alone, prompts, name):
    [output] = llm_alone.generate(prompts[name], GREEDY)
    transformers_log_softmax(prompts[name], output.outputs[0].token_ids, name)


def test_batch_with_chunked_prefill_matches_transformers(prompts):
    """All prompts at once through a 64-token budget: prefills are chunked and share steps with
    other requests' decodes. Greedy tokens must not depend on the company; their logprobs match
    transformers' teacher-forced log-softmax. Then the chat prompts again, which now start from
    prefix-cached KV blocks."""
    llm = LLM(num_kv_blocks=128, max_model_len=1024, max_num_batched_tokens=64, max_num_seqs=16,
              dtype="float32", kv_cache_dtype="float32", num_threads=1)
    steps = []
    execute = llm.engine.runner.execute

    def recording_execute(batch):
        steps.append([(s.request_id, len(s.token_ids), s.start_position, s.num_prompt_tokens)
                      for s in batch.scheduled])
        return execute(batch)

    llm.engine.runner.execute = recording_execute
    names = list(prompts)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=0)
    outputs = llm.generate([prompts[n] for n in names], params)

    answers = {name: output.outputs[0].token_ids for name, output in zip(names, outputs)}
    for name, output in zip(names, outputs):
        log_softmax = transformers_log_softmax(prompts[name], answers[name], name)
        expected = log_softmax[torch.arange(len(answers[name])), torch.tensor(answers[name])]
        got = torch.tensor([lp.logprob for lp in output.outputs[0].logprobs])
        # 3e-3: at up to 16 rows the native matmul rounds activations to two int8 parts,
        # and which attention kernel a chunk takes (SDPA or per-token queries, equally
        # exact in fp32) flips some of those roundings: a chosen token's logprob moved by
        # up to 1.0e-3 between the two, 2.4e-3 from transformers' at worst (plain-digits).
        torch.testing.assert_close(got, expected, atol=3e-3, rtol=0, msg=name)

    # the batch really mixed things: chunked prompts, and steps holding decodes and prefills
    assert max(sum(n for _, n, _, _ in step) for step in steps) <= 64
    assert any(start > 0 and start < prompt_len for step in steps
               for _, _, start, prompt_len in step)  # a prefill resumed in a later chunk
    assert any({n == 1 and start >= prompt_len for _, n, start, prompt_len in step} ==
               {True, False} for step in steps)  # a decode next to a prefill chunk
    assert any(len({rid for rid, _, start, plen in step if start < plen}) > 1
               for step in steps)  # several prefills in one step

    chats = [name for name, p in PROMPTS if not isinstance(p, str)]
    again = llm.generate([prompts[n] for n in chats], GREEDY)
    for name, output in zip(chats, again):
        assert output.num_cached_tokens >= 16, name  # at least one full block reused
        assert output.outputs[0].token_ids == answers[name], name
