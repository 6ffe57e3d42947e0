"""Where a busy `loom serve` spends its CPU: py-spy samples every thread of the server while
`loom bench run` keeps it loaded (closed loop), and each sample is put in one bucket by the
innermost loom function on its stack. Run from the repository root (needs `pip install
py-spy`; py-spy must be allowed to ptrace, as root is):

    python benchmarks/server/server_profile.py --concurrency 32 --server-flags "--async-scheduling"

Buckets: model forward (by op family where py-spy can see it), sampling, input preparation,
scheduling, output processing (detokenize, stop strings, metrics), HTTP + streaming (the
asyncio thread: FastAPI, uvicorn, JSON, SSE), and idle/waiting.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loom.bench.server import LOOM_SERVE, LocalServer

# (bucket, substring of a frame "function (file:line)"), innermost match wins
BUCKETS = [
    ("model: attention", "attention.py"),
    ("model: logits (lm_head)", "compute_logits"),
    ("model: layers (matmuls, norms, rope)", "decoder.py"),
    ("sampling", "sampling.py"),
    ("input preparation", "_prepare"),
    ("input preparation", "_paged_decodes"),
    ("scheduling", "scheduler.py"),
    ("scheduling", "kv_cache.py"),
    ("scheduling", "block_pool.py"),
    ("output processing", "detokenizer.py"),
    ("output processing", "_process"),
    ("output processing", "metrics.py"),
    ("output processing", "_deliver"),
    ("HTTP + streaming", "entrypoints/openai"),
    ("HTTP + streaming", "uvicorn"),
    ("HTTP + streaming", "starlette"),
    ("HTTP + streaming", "fastapi"),
    ("HTTP + streaming", "asyncio"),
    ("HTTP + streaming", "h11"),
]


def bucket_of(stack: list[str]) -> str:
    for frame in reversed(stack):  # innermost first
        if "wait (threading.py" in frame or "_wait_for_work" in frame or "select (" in frame:
            return "idle / waiting"
        for name, needle in BUCKETS:
            if needle in frame:
                return name
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="benchmarks/traces/mixed-64.jsonl")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--server-flags", default="")
    parser.add_argument("--seconds", type=int, default=30, help="py-spy sampling window")
    parser.add_argument("--rate", type=int, default=100, help="py-spy samples per second")
    args = parser.parse_args()
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(py_spy).exists():
        sys.exit("py-spy not found: pip install py-spy")
    with tempfile.TemporaryDirectory() as tmp, LocalServer(
            LOOM_SERVE, args.server_flags, Path(tmp) / "server.log") as server:
        bench = subprocess.Popen(
            [sys.executable, "-m", "loom.cli", "bench", "run", "--base-url",
             server.url, "--trace", args.trace, "--rate", "inf", "--max-concurrency",
             str(args.concurrency), "--duration", str(args.seconds + 30),
             "--out", str(Path(tmp) / "run.json")], stdout=subprocess.DEVNULL)
        time.sleep(10)  # past start-up: prefill bursts and steady decode mixed
        raw = Path(tmp) / "profile.txt"
        subprocess.run([py_spy, "record", "--pid", str(server.pid), "--duration",
                        str(args.seconds), "--rate", str(args.rate), "--threads", "--idle",
                        "--format", "raw", "--output", str(raw), "--nonblocking"],
                       check=True, capture_output=True)
        bench.terminate()
        bench.wait()
        counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        for line in raw.read_text().splitlines():
            stack_text, _, count = line.rpartition(" ")
            frames = stack_text.split(";")
            thread = frames[0]
            kind = ("engine loop" if "loom-engine-loop" in thread
                    else "model worker" if "loom-model" in thread
                    else "HTTP (asyncio)" if "MainThread" in thread or "(" not in thread
                    else thread.split(" ")[0])
            counts[kind][bucket_of(frames[1:])] += int(count)
    total = sum(sum(c.values()) for c in counts.values())
    print(f"\n### Busy `loom serve` {args.server_flags or '(defaults)'}: py-spy, "
          f"{args.seconds} s at {args.rate} Hz, closed loop c={args.concurrency}\n")
    print("| thread | bucket | share of thread's samples | share of all samples |\n"
          "|---|---|---|---|")
    for thread, buckets in sorted(counts.items(), key=lambda kv: -sum(kv[1].values())):
        thread_total = sum(buckets.values())
        for name, n in buckets.most_common():
            if n / total >= 0.002:
                print(f"| {thread} | {name} | {n / thread_total:.1%} | {n / total:.1%} |")


if __name__ == "__main__":
    main()
