"""`loom plan`'s table: one row per (GPU, TP, concurrency), the assumptions behind it and
the serve flags per configuration. Costs appear only with prices you pass."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from loom.plan.models import PlanModel
from loom.plan.planner import PlanSettings

GIB = 2**30


def add_costs(rows: list[dict[str, Any]], prices: dict[str, float]) -> None:
    """$ per hour of the configuration and $ per million output tokens at its roofline decode
    rate, where the GPU has a price."""
    for row in rows:
        price = prices.get(row["gpu"])
        if price is None:
            continue
        per_hour = price * row["num_gpus"]
        row["usd_per_hour"] = per_hour
        row["usd_per_million_output_tokens"] = (
            per_hour / 3600 / row["decode_tok_s"] * 1e6 if row["fits"] else None)


def _gib(n: int | float) -> str:
    return f"{n / GIB:.1f}"


def _rate(x: float | None) -> str:
    """A rate, or "-" where the configuration does not fit (it has no speed)."""
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 10 else f"{x:.2g}"


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    out = []
    for r in rows:
        row = {
            "GPU": r["gpu"], "TP": str(r["tensor_parallel_size"]),
            "Conc.": str(r["concurrency"]),
            "Weights/GPU GiB": _gib(r["weights_bytes_per_gpu"]),
            "KV/token KiB": f"{r['kv_bytes_per_token'] / 1024:.0f}",
            "KV @conc GiB": _gib(r["kv_bytes_at_concurrency"]),
            "Overhead GiB": _gib(r["activation_bytes"] + r["framework_bytes"]),
            "KV budget GiB": _gib(r["kv_budget_bytes"]),
            "Fits": "yes" if r["fits"] else "NO",
            "Max conc. @len": str(r["max_concurrency"]),
            "Max ctx @conc": str(r["max_context_at_concurrency"]),
            **({"Weights read/step GiB": _gib(r["weight_bytes_read_per_decode_step"])}
               if r["params_active"] < r["params_total"] else {}),
            "Decode tok/s/seq": _rate(r["decode_tok_s_per_seq"]),
            "Decode tok/s": _rate(r["decode_tok_s"]),
            "Prefill tok/s": _rate(r["prefill_tok_s"]),
        }
        if "usd_per_hour" in r:
            row["$/h"] = f"{r['usd_per_hour']:.2f}"
            cost = r["usd_per_million_output_tokens"]
            row["$/M out tok"] = "-" if cost is None else f"{cost:.3g}"
        out.append(row)
    return out


def _serve_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (GPU, TP), the first that fits if any does: its serve flags are the
    configuration's (they do not depend on the concurrency)."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["gpu"], r["tensor_parallel_size"])
        if key not in out or (r["fits"] and not out[key]["fits"]):
            out[key] = r
    return list(out.values())


def print_plan(rows: list[dict[str, Any]], model: PlanModel, s: PlanSettings,
               console: Console | None = None) -> None:
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or pipe: room for every column
            console = Console(width=200)
    data = table_rows(rows)
    columns = list(dict.fromkeys(k for row in data for k in row))
    table = Table(title=f"loom plan: {model.name}, max_model_len {s.max_model_len}, weights "
                        f"{s.weight_dtype}, KV {s.kv_dtype}")
    for c in columns:
        table.add_column(c, justify="left" if c == "GPU" else "right")
    for row in data:
        table.add_row(*(row.get(c, "-") for c in columns))
    console.print(table)
    _print_model(rows, model, s, console)
    e = s.efficiency
    console.print(
        f"Safety margin {s.safety_margin:.0%} of memory; overhead = activations at "
        f"max_num_batched_tokens={s.max_num_batched_tokens} + logits of max_num_seqs="
        f"{s.max_num_seqs} + {s.framework_bytes / GIB:.2f} GiB framework. Roofline: "
        f"{e.bandwidth:.0%} of memory bandwidth, {e.compute:.0%} of dense tensor FLOP/s, "
        f"{e.interconnect:.0%} of the link, {e.step_overhead_s * 1e3:g} ms per step; decode "
        "at the full max_model_len context (worst case). A model, not a measurement: "
        "benchmark the configuration you pick.", highlight=False)
    for r in _serve_rows(rows):
        console.print(f"[bold]{r['gpu']} x{r['tensor_parallel_size']}[/bold]", highlight=False)
        if not r["fits"]:
            console.print(f"  does not fit at max_model_len {s.max_model_len} for any "
                          "concurrency asked: no serve command", highlight=False)
            continue
        if r["flags"]["loom_serve"]:
            if r["flags"]["download"]:  # loom reads from disk; vllm fetches the name itself
                console.print(f"  {r['flags']['download']}", highlight=False, soft_wrap=True)
            console.print(f"  {r['flags']['loom_serve']}", highlight=False, soft_wrap=True)
        console.print(f"  {r['flags']['vllm_serve']}", highlight=False, soft_wrap=True)
        for note in r["notes"]:
            console.print(f"  ({note})", highlight=False, soft_wrap=True)
        if r["flags"]["note"]:
            console.print(f"  ({r['flags']['note']})", highlight=False, soft_wrap=True)



def _print_model(rows: list[dict[str, Any]], model: PlanModel, s: PlanSettings,
                 console: Console) -> None:
    """Total vs active parameters of a mixture of experts, and what its weight reads mean."""
    if model.note:
        console.print(f"{model.name}: {model.note}", highlight=False, soft_wrap=True)
    arch = model.arch
    if not arch.num_experts:
        return
    console.print(
        f"{model.name}: {arch.num_parameters / 1e9:.1f}B parameters, "
        f"{arch.num_active_parameters / 1e9:.1f}B active per token ({arch.num_experts_per_tok} "
        f"of {arch.num_experts} experts); weights are held whole, a decode step of B "
        f"sequences reads the experts its tokens touch, E(1-(1-k/E)^B) per layer (uniform "
        f"routing, an upper estimate). Experts "
        + ("placed whole, num_experts/TP per GPU (expert parallel)." if s.expert_parallel
           else "sliced across the TP GPUs."), highlight=False, soft_wrap=True)
