"""Data-parallel loom on Ray Serve, measured on this machine with `loom bench run`.

Suites (--suites, default all):

  dp    the mixed trace at C = 8 and 32 (closed loop): `--data-parallel-size 2 --num-threads 1`
        vs one engine with `--num-threads 2`; the same KV memory in all (the replicas split it)
  rag   a RAG trace of several documents (each request: one document + its own question) at
        C = 4 through 2 replicas: --router prefix vs pow2 vs round-robin; prefix-cache hit rate
        over the run, read from the front end's one /metrics scrape (all replicas)
  hop   C = 1 on the mixed trace: 2 replicas x 1 thread through Ray (one request at a time, so
        one replica works and the other idles) vs the in-process server with 1 thread: the cost
        of the hop to the replica
  router  the policy alone (loom.cluster.routing, no Ray): routing decisions per second for
        fleets of 10 / 100 / 1,000 replicas on 2,048-token prompts over shared documents

Every run starts its server on a free port (LocalServer), waits for /health, warms it up with
two short requests that share nothing with the traces, runs `loom bench run --rate inf
--max-concurrency C` and stops the server (a server per run: no cache carries over). Run it
under the benchmark lock, on a machine with nothing else benchmarking:

    flock /tmp/loom-bench.lock .venv/bin/python benchmarks/server/cluster.py --suites dp,rag,hop
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.harness import CHECKOUT, commit, host_line  # noqa: E402
from loom import host  # noqa: E402
from loom.bench.server import LOOM_SERVE, LocalServer  # noqa: E402
from loom.workload.trace import Trace, TraceRequest, load_trace, write_trace  # noqa: E402

REPO = CHECKOUT
MIXED = REPO / "benchmarks/traces/mixed-40.jsonl"
WARMUP = "Warm-up: say hello."
METRICS_SETTLE_S = 3.0  # replicas push their metrics every second or so


def rag_trace(path: Path, documents: int, per_document: int, seed: int) -> Path:
    """Documents of ~500 tokens, each asked `per_document` questions, in a shuffled order;
    words drawn from the bundled RAG trace's text so the lengths are realistic."""
    words = load_trace(REPO / "benchmarks/traces/rag-20.jsonl").requests[0].prompt.split()
    rng = random.Random(seed)
    docs = [" ".join(rng.sample(words, 400)) for _ in range(documents)]
    order = [d for d in range(documents) for _ in range(per_document)]
    rng.shuffle(order)
    requests = [TraceRequest(max_tokens=rng.randint(8, 32), cls=f"doc{d}", id=f"rag-{i:03d}",
                             prompt=f"{docs[d]}\nQuestion {i}: {' '.join(rng.sample(words, 12))}?")
                for i, d in enumerate(order)]
    write_trace(Trace(requests, {"kind": "rag-documents", "documents": documents,
                                 "seed": seed}, sha256=""), path)
    return path


def router_speed(sizes: tuple[int, ...] = (10, 100, 1000), prompt_len: int = 2048,
                 decisions: int = 2000) -> list[dict[str, Any]]:
    """choose + record per second, hashing included (the front end hashes every prompt)."""
    from loom.cluster.routing import make_policy, prompt_block_hashes

    rng = random.Random(0)
    docs = [[rng.randrange(50_000) for _ in range(prompt_len - 64)] for _ in range(200)]
    prompts = [rng.choice(docs) + [rng.randrange(50_000) for _ in range(64)]
               for _ in range(decisions)]
    rows = []
    for size in sizes:
        policy = make_policy("prefix", size)
        queues = [rng.randrange(8) for _ in range(size)]
        start = time.perf_counter()
        for prompt in prompts:
            hashes = prompt_block_hashes(prompt, 16)
            policy.record(policy.choose(hashes, queues), hashes)
        per_s = decisions / (time.perf_counter() - start)
        rows.append({"replicas": size, "decisions_per_s": per_s})
        _say(f"router, {size} replicas: {per_s:,.0f} decisions/s")
    return rows


def scrape(url: str, name: str) -> float:
    """A metric summed over every replica (and label) of the front end's one scrape."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name)


def warm_up(url: str) -> None:
    for _ in range(2):
        httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "any", "prompt": WARMUP, "max_tokens": 8, "temperature": 0,
        }).raise_for_status()


def run(name: str, flags: str, trace: Path, concurrency: int, out_dir: Path) -> dict[str, Any]:
    """One server, one closed-loop run: the row of figures."""
    tag = f"{name}-c{concurrency}".replace(" ", "_")
    server = LocalServer(LOOM_SERVE, flags, out_dir / f"{tag}.server.log", 600.0)
    with server:
        warm_up(server.url)
        time.sleep(METRICS_SETTLE_S)
        hits0 = scrape(server.url, "loom:prefix_cache_hits_total")
        queries0 = scrape(server.url, "loom:prefix_cache_queries_total")
        result_path = out_dir / f"{tag}.json"
        cmd = [sys.executable, "-m", "loom.cli", "bench", "run",
               "--base-url", server.url, "--trace", str(trace), "--rate", "inf",
               "--max-concurrency", str(concurrency), "--out", str(result_path),
               "--label", f"{name} x{concurrency}"]
        with open(out_dir / f"{tag}.bench.log", "wb") as log:
            subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=True)
        time.sleep(METRICS_SETTLE_S)
        hits = scrape(server.url, "loom:prefix_cache_hits_total") - hits0
        queries = scrape(server.url, "loom:prefix_cache_queries_total") - queries0
    result = json.loads(result_path.read_text())
    row = {"name": name, "flags": flags, "concurrency": concurrency,
           "hit_rate": hits / queries if queries else None,
           "startup_s": server.startup_s}
    row.update({k: result.get(k) for k in ("output_throughput", "mean_ttft_ms", "p95_ttft_ms",
                                           "median_itl_ms", "p95_itl_ms", "completed",
                                           "failed")})
    _say(f"{name} x{concurrency}: {row['output_throughput']:.1f} tok/s, p95 TTFT "
         f"{row['p95_ttft_ms']:.0f} ms, hit rate {row['hit_rate']}")
    return row


def server_suites(args: argparse.Namespace, out_dir: Path) -> list[dict[str, Any]]:
    kv = args.kv_cache_memory_mib
    one = f"--kv-cache-memory {kv}MiB"
    dp2 = f"--data-parallel-size 2 --num-threads 1 --kv-cache-memory {kv // 2}MiB"
    rows = []
    if "dp" in args.suites:
        for c in (8, 32):
            rows.append(run("1 engine x 2 threads", f"--num-threads 2 {one}", MIXED, c, out_dir))
            rows.append(run("DP=2 x 1 thread", dp2, MIXED, c, out_dir))
    if "rag" in args.suites:
        trace = rag_trace(out_dir / "rag-docs.jsonl", args.documents, args.per_document, 0)
        for router in ("prefix", "pow2", "round-robin"):
            rows.append(run(f"DP=2 --router {router}", f"{dp2} --router {router}", trace, 4,
                            out_dir))
    if "hop" in args.suites:
        rows.append(run("in-process x 1 thread", f"--num-threads 1 {one}", MIXED, 1, out_dir))
        rows.append(run("Ray DP=2 x 1 thread", dp2, MIXED, 1, out_dir))
    return rows


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| run | C | out tok/s | mean TTFT ms | p95 TTFT ms | p50 ITL ms | p95 ITL ms | "
             "prefix hit rate | ok / failed |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        hit = "" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.0f}%"
        lines.append(f"| {r['name']} | {r['concurrency']} | {r['output_throughput']:.1f} | "
                     f"{r['mean_ttft_ms']:.0f} | {r['p95_ttft_ms']:.0f} | "
                     f"{r['median_itl_ms']:.1f} | {r['p95_itl_ms']:.1f} | {hit} | "
                     f"{r['completed']} / {r['failed']} |")
    return "\n".join(lines)


def _say(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", type=lambda s: s.split(","),
                    default=["dp", "rag", "hop", "router"])
    ap.add_argument("--kv-cache-memory-mib", type=int, default=1024,
                    help="KV memory in all: one engine gets it whole, each of 2 replicas half")
    ap.add_argument("--documents", type=int, default=4)
    ap.add_argument("--per-document", type=int, default=8)
    ap.add_argument("--out-dir", type=Path, default=None)
    args = ap.parse_args()
    stamp = f"cluster-{dt.datetime.now():%Y%m%d-%H%M}"
    out_dir = args.out_dir or REPO / "benchmarks/results" / stamp
    out_dir.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.timezone.utc)
    rows = server_suites(args, out_dir)
    router = router_speed() if "router" in args.suites else []
    table = markdown(rows)
    (out_dir / "summary.json").write_text(json.dumps(
        {"rows": rows, "router": router, "host": host.describe(), "commit": commit(),
         "date": started.isoformat(timespec="seconds"),
         "command": shlex.join(sys.argv)}, indent=2))
    print(f"\n{host_line()}\n")
    print(table)
    if router:
        print("\n| replicas | routing decisions/s (prefix, 2,048-token prompts, hashing "
              "included) |\n|---|---|")
        print("\n".join(f"| {r['replicas']:,} | {r['decisions_per_s']:,.0f} |" for r in router))
    return 0


if __name__ == "__main__":
    sys.exit(main())
