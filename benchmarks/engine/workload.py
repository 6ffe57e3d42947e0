"""The engine issue's mixed workload: 64 requests, all arriving at once.

60% short chats (~35 prompt tokens, 16-96 output), 15% long prompts (500-1100 prompt, 32-128
output), 25% RAG-style requests sharing one 480-token prefix plus a short question (8-160
output) — the length distributions of `loom bench trace` (loom.bench.trace.CLASSES), but with
exact class counts. Every request uses ignore_eos so output lengths are exactly the drawn ones.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from tokenizers import Tokenizer

from loom import SamplingParams
from loom.engine.core import EngineCore
from loom.workload.mix import CLASSES
from loom.workload.tokens import PromptSynth, load_tokenizer

MIX = {"chat": 0.60, "long": 0.15, "rag": 0.25}


@dataclass(frozen=True)
class WorkItem:
    request_class: str  # "chat" | "long" | "rag"
    prompt_token_ids: list[int]
    max_tokens: int


def mixed_workload(tokenizer: Tokenizer, n: int = 64, seed: int = 0) -> list[WorkItem]:
    rng = random.Random(seed)
    synth = PromptSynth(tokenizer)
    counts = {"chat": round(MIX["chat"] * n), "long": round(MIX["long"] * n)}
    counts["rag"] = n - counts["chat"] - counts["long"]
    shared_prefix = synth.text(CLASSES["rag"].shared_prefix_len, random.Random(seed + 1))
    items = []
    for name, count in counts.items():
        spec = CLASSES[name]
        prefix = shared_prefix if spec.shared_prefix_len else ""
        for _ in range(count):
            text = prefix + synth.text(spec.prompt_len.sample(rng), rng, prefix=prefix)
            ids = tokenizer.encode(text, add_special_tokens=False).ids
            items.append(WorkItem(name, ids, spec.output_len.sample(rng)))
    rng.shuffle(items)
    return items


def bundled_tokenizer() -> Tokenizer:
    """The bundled model's tokenizer, read from its GGUF metadata without the weights."""
    return load_tokenizer(None)


def queue_work(engine: EngineCore, items: list[WorkItem], temperature: float = 0.0) -> None:
    """Queue every item at once: greedy unless `temperature`, ignore_eos."""
    for i, item in enumerate(items):
        engine.add_request(f"r{i}", item.prompt_token_ids, SamplingParams(
            max_tokens=item.max_tokens, temperature=temperature, ignore_eos=True))


def run_offline(engine: EngineCore, items: list[WorkItem], temperature: float = 0.0) -> float:
    """Queue every item at once and step until all finish; wall seconds."""
    queue_work(engine, items, temperature)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def run_interleaved(engines: dict[str, EngineCore], items: list[WorkItem],
                    temperature: float = 0.0) -> dict[str, float]:
    """Every engine runs the same items (queued at once), the engines stepping in turn, one
    step each, every step timed: the seconds each engine spent in its own steps.

    Run one after the other, two engines see different moments of a shared machine, and a
    few percent between them drowns in its drift; stepped in turn, anything slowing the
    machine for longer than a few steps slows both alike, so their ratio keeps small effects.
    """
    for engine in engines.values():
        queue_work(engine, items, temperature)
    seconds = dict.fromkeys(engines, 0.0)
    while any(engine.has_unfinished_requests() for engine in engines.values()):
        for label, engine in engines.items():
            if engine.has_unfinished_requests():
                start = time.perf_counter()
                engine.step()
                seconds[label] += time.perf_counter() - start
    return seconds


def interleaved_rounds(engines: dict[str, EngineCore], items: list[WorkItem], rounds: int,
                       temperature: float = 0.0,
                       report: Callable[[int, dict[str, float]], None] | None = None
                       ) -> dict[str, list[float]]:
    """Output tok/s of each engine per round of run_interleaved (over its own step time),
    which engine steps first alternating by round; the prefix caches are emptied before each
    round, so every round prefills alike. `report(round, seconds in each engine's steps)`
    after each round, for progress."""
    output_tokens = sum(item.max_tokens for item in items)
    rates: dict[str, list[float]] = {label: [] for label in engines}
    for r in range(rounds):
        order = list(engines) if r % 2 == 0 else list(reversed(engines))
        for engine in engines.values():
            engine.kv_cache.pool.reset_prefix_cache()
        seconds = run_interleaved({label: engines[label] for label in order}, items,
                                  temperature)
        for label in order:
            rates[label].append(output_tokens / seconds[label])
        if report is not None:
            report(r + 1, seconds)
    return rates
