"""Where the mixed workload's model time goes: the engine issue's 64 requests offline at the
default settings, with wall-clock timers around the forward pass, the projection matmuls
(every `Linear` call, lm_head included, split by whether the native block-quantized kernel or
oneDNN/torch ran it), the native attention call (RoPE, the KV writes and the attention of
decode rows and of the prefill chunks that attend per token, one call a layer; or the decode
kernel alone, where the model calls it so) and the prefill SDPA calls. What is left of the
forward pass is norms, the MLP's elementwise ops, the torch path's RoPE and KV writes, and
dispatch (the torch profiler cannot see the native kernels, hence these timers). --max-num-seqs C
queues all 64 but runs at most C at once, like C closed-loop users. Run from the repository
root:

    python benchmarks/engine/attention_share.py
    python benchmarks/engine/attention_share.py --max-num-seqs 8
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom.model.attention as attention  # noqa: E402
from benchmarks.engine.workload import bundled_tokenizer, mixed_workload, run_offline  # noqa: E402
from benchmarks.harness import host_line  # noqa: E402
from loom import LLM  # noqa: E402
from loom.model.linear import Linear  # noqa: E402

seconds: dict[str, float] = {"forward": 0.0, "matmuls, native kernel": 0.0,
                             "matmuls, oneDNN/torch": 0.0,
                             "RoPE + KV write + attention, native": 0.0, "decode kernel": 0.0,
                             "prefill SDPA": 0.0, "lm_head (outside forward)": 0.0}
NOT_PARTS_OF_FORWARD = ("forward", "lm_head (outside forward)")


def timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = fn(*args, **kwargs)
        seconds[name] += time.perf_counter() - start
        return result
    return wrapper


class TimedOps:
    """The compiled kernel module with its two attention entry points timed."""

    def __init__(self, ops: Any) -> None:
        self._ops = ops
        self.paged_decode_attention = timed("decode kernel", ops.paged_decode_attention)
        self.rope_write_decode = timed("RoPE + KV write + attention, native",
                                       ops.rope_write_decode)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ops, name)


def timed_linear(call: Callable[..., Any], lm_head: Linear) -> Callable[..., Any]:
    def wrapper(self: Linear, x: Any) -> Any:
        if self is lm_head:  # timed as compute_logits
            return call(self, x)
        native = self.panels is not None
        start = time.perf_counter()
        result = call(self, x)
        seconds["matmuls, native kernel" if native else "matmuls, oneDNN/torch"] += (
            time.perf_counter() - start)
        return result
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-num-seqs", type=int, default=None)
    args = parser.parse_args()
    print(host_line())
    items = mixed_workload(bundled_tokenizer())
    extra = {"max_num_seqs": args.max_num_seqs} if args.max_num_seqs else {}
    engine = LLM(kv_cache_memory="1536MiB", **extra).engine
    run_offline(engine, items[:2])  # warm-up
    model = engine.runner.model
    Linear.__call__ = timed_linear(Linear.__call__, model.lm_head)  # type: ignore[method-assign]
    model.compute_logits = timed("lm_head (outside forward)", model.compute_logits)
    timed_ops = TimedOps(attention.paged_attention_ops())
    attention.paged_attention_ops = lambda: timed_ops
    attention.F.scaled_dot_product_attention = timed(
        "prefill SDPA", attention.F.scaled_dot_product_attention)
    model.forward = timed("forward", model.forward)
    wall = run_offline(engine, items)
    rest = seconds["forward"] - sum(v for k, v in seconds.items() if k not in NOT_PARTS_OF_FORWARD)
    print(f"| part | seconds | share of wall |\n|---|--:|--:|\n| wall | {wall:.1f} | 100% |")
    for name, value in [*seconds.items(), ("rest of the forward pass", rest)]:
        print(f"| {name} | {value:.1f} | {value / wall:.0%} |")


if __name__ == "__main__":
    main()
