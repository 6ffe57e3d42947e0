"""Time `loom serve` from launch to a healthy /health, and its memory when it gets there, for
one or more source trees (each with flags of its own if need be) side by side, taking turns
(A B, B A, ...). Run from the repository root, e.g.:

    python benchmarks/server/startup.py --rounds 3
    python benchmarks/server/startup.py --src old=/tmp/wt-base/src --src new=src --rounds 3
    python benchmarks/server/startup.py --src thread=src=--engine-in-process --src process=src

Each run is a fresh server process (`python -m loom.cli serve`) with that tree
first on PYTHONPATH. One untimed start per tree first builds its C++ kernels. Memory is the
VmHWM (peak resident) and VmRSS from /proc once it answers, summed over the server's
process tree (with an engine process, two peaks added: an upper bound of the tree's).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.harness import host_line, round_order  # noqa: E402
from benchmarks.server.source_trees import SERVE, add_src_argument, source_trees  # noqa: E402
from loom.bench.server import LocalServer  # noqa: E402
from loom.bench.sysinfo import process_memory  # noqa: E402


def memory_mib(pid: int) -> dict[str, float]:
    """The server's peak (VmHWM) and current (VmRSS) resident memory, MiB."""
    mem = process_memory(pid) or {"hwm_bytes": 0, "rss_bytes": 0}
    return {"VmHWM": mem["hwm_bytes"] / 2**20, "VmRSS": mem["rss_bytes"] / 2**20}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_src_argument(parser)
    parser.add_argument("--server-flags", default="", help="flags for every `loom serve`")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    runs = source_trees(args, args.server_flags)
    print(host_line())
    results: dict[str, list[tuple[float, float, float]]] = {label: [] for label in runs}
    with tempfile.TemporaryDirectory() as logs:
        for r in range(-1, args.rounds):  # round -1: one untimed start each
            for label, (src, flags) in round_order(list(runs.items()), max(r, 0)):
                env = {"PYTHONPATH": src}
                log = Path(logs) / f"{label.replace('/', '-')}-{r}.log"
                with LocalServer(SERVE, flags, log, env=env) as server:
                    mem = memory_mib(server.pid)
                if r < 0:
                    continue  # the warm-up start
                results[label].append((server.startup_s, mem["VmHWM"], mem["VmRSS"]))
                print(f"round {r + 1} {label}: healthy after {server.startup_s:.2f} s, "
                      f"peak {mem['VmHWM']:.0f} MiB, resident {mem['VmRSS']:.0f} MiB", flush=True)
    print("\n| tree | start-up s (median) | peak MiB | resident MiB |\n|---|--:|--:|--:|")
    for label, measured in results.items():
        start, peak, rss = (statistics.median(x) for x in zip(*measured))
        print(f"| {label} | {start:.2f} | {peak:.0f} | {rss:.0f} |")


if __name__ == "__main__":
    main()
