"""The engine issue's mixed workload: 64 requests, all arriving at once.

60% short chats (~35 prompt tokens, 16-96 output), 15% long prompts (500-1100 prompt, 32-128
output), 25% RAG-style requests sharing one 480-token prefix plus a short question (8-160
output). Prompts are real English-like text, tokenized and cut to exact token counts; every
request uses ignore_eos so output lengths are exactly the drawn ones.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from loom.model.tokenizer import Tokenizer

_WORDS = ("the model serves many users at once and each request brings its own prompt while "
          "the scheduler decides which sequences run in the next step memory is kept in pages "
          "so that long and short answers can share the cache without waste a good benchmark "
          "replays realistic traffic and measures latency throughput queueing and errors before "
          "anyone picks a setting or buys a machine people ask about cooking travel code history "
          "science music sport and weather in many different ways").split()


@dataclass(frozen=True)
class WorkItem:
    request_class: str  # "chat" | "long" | "rag"
    prompt_token_ids: list[int]
    max_tokens: int


def _text_tokens(tokenizer: Tokenizer, rng: random.Random, num_tokens: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < num_tokens:
        words = " ".join(rng.choice(_WORDS) for _ in range(num_tokens))
        ids += tokenizer.encode(" " + words, add_special_tokens=False)
    return ids[:num_tokens]


def mixed_workload(tokenizer: Tokenizer, n: int = 64, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    shared_prefix = _text_tokens(tokenizer, random.Random(seed + 1), 480)
    counts = {"chat": round(0.60 * n), "long": round(0.15 * n)}
    counts["rag"] = n - counts["chat"] - counts["long"]
    items = []
    for request_class, count in counts.items():
        for _ in range(count):
            if request_class == "chat":
                prompt = _text_tokens(tokenizer, rng, rng.randint(25, 45))
                max_tokens = rng.randint(16, 96)
            elif request_class == "long":
                prompt = _text_tokens(tokenizer, rng, rng.randint(500, 1100))
                max_tokens = rng.randint(32, 128)
            else:
                prompt = shared_prefix + _text_tokens(tokenizer, rng, rng.randint(10, 30))
                max_tokens = rng.randint(8, 160)
            items.append(WorkItem(request_class, prompt, max_tokens))
    rng.shuffle(items)
    return items


def bundled_tokenizer() -> Tokenizer:
    """The bundled model's tokenizer, without loading its weights into a model."""
    from loom.model.loader import load_model

    return load_model(None).tokenizer
