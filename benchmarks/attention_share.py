"""How much of the mixed workload's model time is attention: the engine issue's 64 requests
offline at the default settings, with wall-clock timers around the forward pass, the native
decode-attention kernel and the prefill SDPA calls. What is left of the forward pass is the
projection matmuls plus norms, RoPE and the MLP's elementwise ops (the torch profiler puts
the matmuls at ~75% of the op time; it cannot see the native kernel, hence these timers).
Run from the repository root:

    python benchmarks/attention_share.py
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, "benchmarks")
from workload import bundled_tokenizer, mixed_workload, run_offline  # noqa: E402

import loom.model.attention as attention  # noqa: E402
from loom import LLM  # noqa: E402

seconds: dict[str, float] = {"forward": 0.0, "decode kernel": 0.0, "prefill SDPA": 0.0}


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds[name] += time.perf_counter() - start
        return result
    return wrapper


class TimedOps:
    """The compiled kernel module with its decode call timed."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops
        self.paged_decode_attention = timed("decode kernel", ops.paged_decode_attention)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)


def main() -> None:
    items = mixed_workload(bundled_tokenizer())
    engine = LLM(kv_cache_memory="1536MiB").engine
    run_offline(engine, items[:2])  # warm-up
    timed_ops = TimedOps(attention.paged_attention_ops())
    attention.paged_attention_ops = lambda: timed_ops
    attention.F.scaled_dot_product_attention = timed(
        "prefill SDPA", attention.F.scaled_dot_product_attention)
    model = engine.runner.model
    model.forward = timed("forward", model.forward)
    wall = run_offline(engine, items)
    rest = seconds["forward"] - seconds["decode kernel"] - seconds["prefill SDPA"]
    print(f"| part | seconds | share of wall |\n|---|--:|--:|\n| wall | {wall:.1f} | 100% |")
    for name, value in [*seconds.items(), ("forward minus attention", rest)]:
        print(f"| {name} | {value:.1f} | {value / wall:.0%} |")


if __name__ == "__main__":
    main()
