"""The scorecard: one row per run (configuration x offered load), in Markdown and as a rich
table, plus per-class rows (fairness).

Goodput (completed req/s within an SLO) and, given a GPU price, the cost per accepted answer
are here because the configuration to pick is the one that meets the latency and reliability
targets at the lowest cost per accepted answer, not the one with the most tokens per second.
In a terminal narrower than the table only the key columns are shown (`wide` for all).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from loom.bench.repeats import differences
from loom.workload.figures import Figures, Goodput, request_figures
from loom.workload.results import RunResult, as_runs, run_label
from loom.workload.slo import Slo

Runs = Sequence[RunResult | Mapping[str, Any]]  # typed runs, or as their files hold them
Groups = Sequence[tuple[str, Runs]]

# The columns that decide between configurations; they fit an 80-column terminal.
KEY_COLUMNS = ("Run", "Class", "Offered req/s", "Completed req/s", "Output tok/s", "p95 TTFT s",
               "p95 ITL ms", "p95 E2E s", "Error rate", "Goodput req/s", "Client")
_NARROW_DROPS = {"Scorecard": ("p95 E2E s",)}  # at 80 columns; the per-class table keeps it
_ALL_COLUMNS_WIDTH = 220


def shown_label(run: RunResult) -> str:
    """A run's name wherever it is shown; a simulated run says so."""
    label = run_label(run)
    return f"{label} (simulated)" if run.simulated and "simulated" not in label else label


def _s(ms: float | None) -> str:
    return "-" if ms is None else f"{ms / 1000:.2f}"


def _ms(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.0f}"


def _ci(run: RunResult, key: str, fmt: Callable[[Any], str]) -> str:
    """A figure, and with repeats its median's 95% interval: '1.23 [1.10-1.40]'."""
    value = run.figures.get(key)
    text = "-" if value is None else fmt(value)
    interval = run.ci.get(key)
    return f"{text} [{fmt(interval[0])}-{fmt(interval[1])}]" if interval else text


def offered(run: RunResult) -> str:
    if run.closed_loop and run.max_concurrency:
        return f"{run.max_concurrency} users"
    return f"{run.offered_rate:.2f}"


def _goodput(run: RunResult, slo: Slo | None) -> Goodput | None:
    """The run's goodput under `slo` (recomputed from its requests), or as recorded."""
    if slo is None:
        return run.figures.goodput
    return request_figures(run.requests, run.duration, slo).goodput


def rows(runs: Runs, slo: Slo | None = None,
         gpu_cost_per_hour: float | None = None) -> list[dict[str, str]]:
    runs = as_runs(runs)
    out = []
    flag_clients = any(run.client.limited for run in runs)
    for run in runs:
        queue = run.metrics.queue_time.p95 if run.metrics.queue_time else None
        row = {
            "Run": shown_label(run), "Offered req/s": offered(run),
            "Completed req/s": _ci(run, "request_throughput", "{:.2f}".format),
            "Output tok/s": _ci(run, "output_throughput", "{:.1f}".format),
            "p50 TTFT s": _ci(run, "median_ttft_ms", _s),
            "p95 TTFT s": _ci(run, "p95_ttft_ms", _s),
            "p95 ITL ms": _ci(run, "p95_itl_ms", _ms),
            "mean TPOT ms": _ci(run, "mean_tpot_ms", _ms),
            "p95 queue s": _s(queue),
            "p95 E2E s": _ci(run, "p95_e2el_ms", _s),
            "Error rate": _ci(run, "error_rate", "{:.1%}".format),
            "Preemptions": "-" if run.metrics.preemptions is None
            else str(run.metrics.preemptions),
            "KV peak": "-" if run.metrics.kv_cache_usage.peak is None
            else f"{run.metrics.kv_cache_usage.peak:.0%}",
        }
        if flag_clients:
            row["Client"] = "LIMITED" if run.client.limited else "ok"
        goodput = _goodput(run, slo)
        if goodput:
            row["Goodput req/s"] = f"{goodput.request_goodput:.2f}"
            row["SLO met"] = {True: "yes", False: "no", None: "-"}[goodput.slo_met]
        if gpu_cost_per_hour is not None:
            accepted = goodput.good if goodput else run.figures.completed
            cost = gpu_cost_per_hour * run.duration / 3600
            row["$ / accepted answer"] = f"{cost / accepted:.3g}" if accepted else "-"
        out.append(row)
    return out


def class_rows(runs: Runs, slo: Slo | None = None) -> list[dict[str, str]]:
    out = []
    for run in as_runs(runs):
        for cls, f in run.per_class.items():
            if slo is not None:
                f = request_figures([r for r in run.requests if r.cls == cls], run.duration, slo)
            out.append(_class_row(shown_label(run), cls, f))
    return out


def _class_row(label: str, cls: str, f: Figures) -> dict[str, str]:
    row = {"Run": label, "Class": cls, "Requests": str(f.num_prompts),
           "Completed": str(f.completed), "Failed": str(f.failed),
           "Cancelled": str(f.cancelled), "Completed req/s": f"{f.request_throughput:.2f}",
           "p50 TTFT s": _s(f.ttft.median), "p95 TTFT s": _s(f.ttft.p95),
           "mean TPOT ms": _ms(f.tpot.mean), "p95 E2E s": _s(f.e2el.p95)}
    if f.request_goodput is not None:
        row["Goodput req/s"] = f"{f.request_goodput:.2f}"
    return row


def _columns(table: list[dict[str, str]]) -> list[str]:
    return list(dict.fromkeys(k for row in table for k in row))


def markdown_table(table: list[dict[str, str]]) -> str:
    columns = _columns(table)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row.get(c, "-") for c in columns) + " |" for row in table]
    return "\n".join(lines)


def _notes(slo: Slo | None, runs: list[RunResult], cost: float | None) -> str:
    slo_text = str(slo) if slo else next((r.slo for r in runs if r.slo), None)
    notes = ["Completed req/s counts requests that finished; error rate = failed "
             "(errors + 503 rejections) / sent; p95 queue is the server's own queue-time "
             "histogram (- when it exports none)."]
    if slo_text:
        notes.append(f"Goodput: completed req/s of requests within the SLO {slo_text} "
                     "(per request: TTFT and E2E within the limits).")
    for run in (r for r in runs if r.client.limited):
        notes.append(f"Client LIMITED in {shown_label(run)}: "
                     f"{'; '.join(run.client.limited_reasons or [])}. The client, not the "
                     "server, limited this run: its figures measure the client (loom diagnose "
                     "says what to change).")
    if cost is not None:
        notes.append(f"Cost per accepted answer at ${cost:g}/h: run time x price / accepted "
                     "answers (good ones when an SLO is given).")
    return "\n".join(notes)


def difference_rows(groups: Groups) -> list[dict[str, str]]:
    """Each configuration against the first, per point and figure, with repeats: the two
    medians, the difference's 95% interval and whether it is inside the noise."""
    out = []
    for d in differences(groups):
        fmt = _FIGURE_FORMATS[d.figure]
        low, high = d.difference_ci
        out.append({"Point": _point_text(d.point), "Figure": d.figure,
                    d.baseline: fmt(d.baseline_median), "vs": d.config,
                    "median": fmt(d.median), "difference 95% CI": f"{fmt(low)} to {fmt(high)}",
                    "Verdict": "inside the noise" if d.verdict == "noise" else d.verdict})
    return out


_FIGURE_FORMATS: dict[str, Callable[[Any], str]] = {
    "request_throughput": "{:.3f}".format, "output_throughput": "{:.1f}".format,
    "request_goodput": "{:.3f}".format, "error_rate": "{:.1%}".format,
    **{k: _ms for k in ("median_ttft_ms", "p95_ttft_ms", "p95_itl_ms", "mean_tpot_ms",
                        "p95_e2el_ms")}}


def _point_text(point: tuple[Any, Any]) -> str:
    rate, users = point
    if rate == "inf" and users:
        return f"{users} users"
    return f"{rate}/s" if isinstance(rate, (int, float)) else str(rate)


def markdown(runs: Runs, slo: Slo | None = None, gpu_cost_per_hour: float | None = None,
             title: str = "Scorecard", groups: Groups | None = None) -> str:
    runs = as_runs(runs)
    parts = [f"# {title}", "", markdown_table(rows(runs, slo, gpu_cost_per_hour)), "",
             _notes(slo, runs, gpu_cost_per_hour)]
    diffs = difference_rows(groups or [])
    if diffs:
        parts += ["", "## Differences against the first configuration (repeats)", "",
                  markdown_table(diffs), "",
                  "Figures are medians over the repeats with a bootstrap 95% interval; a "
                  "difference whose interval holds 0 is inside the noise."]
    parts += ["", "## Per request class (fairness)", "", markdown_table(class_rows(runs, slo))]
    traces = sorted({r.trace.sha256 for r in runs if r.trace.sha256})
    if traces:
        parts += ["", "Trace sha256: " + ", ".join(traces)]
    return "\n".join(parts) + "\n"


def _rich(table: list[dict[str, str]], title: str, columns: list[str],
          narrow: bool = False) -> Table:
    """The table; `narrow` drops the vertical rules, which leaves the numbers room at 80
    columns."""
    out = Table(title=title, box=box.SIMPLE_HEAD if narrow else box.HEAVY_HEAD)
    for column in columns:  # fold, never truncate: a cut-off number reads as another one
        label = column in ("Run", "Class")
        words = column.split() + [w for row in table for w in row.get(column, "").split()]
        out.add_column(column, justify="left" if label else "right", overflow="fold",
                       max_width=None if label else max(map(len, words)))
    for row in table:
        out.add_row(*(row.get(c, "-") for c in columns))
    return out


def print_scorecard(runs: Runs, slo: Slo | None = None,
                    gpu_cost_per_hour: float | None = None,
                    console: Console | None = None, wide: bool = False,
                    groups: Groups | None = None) -> None:
    """The scorecard and per-class table. A log file or pipe gets every column; a terminal
    narrower than that only the key columns, unless `wide`."""
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file or pipe: room for every column, no wrapping
            console = Console(width=_ALL_COLUMNS_WIDTH)
    narrow = not wide and console.width < _ALL_COLUMNS_WIDTH
    runs = as_runs(runs)
    for table, title in ((rows(runs, slo, gpu_cost_per_hour), "Scorecard"),
                         (class_rows(runs, slo), "Per request class")):
        columns = _columns(table)
        if narrow:
            columns = [c for c in columns if c in KEY_COLUMNS
                       and c not in _NARROW_DROPS.get(title, ())]
            title += " (key columns; --wide for all)"
        console.print(_rich(table, title, columns, narrow))
    diffs = difference_rows(groups or [])
    if diffs:
        console.print(_rich(diffs, "Differences against the first configuration (repeats)",
                            _columns(diffs), narrow))
