"""`loom bench report DIR`: the decision report of a comparison, in two files.

DIR/report.html is one self-contained page (styles inline, plots inline as base64 PNG, no
script or font fetched from anywhere), so it can be mailed or attached to a ticket as it is;
DIR/report.md is its Markdown twin (plots beside it as report-*.png). Both hold the same
sections: the decision checklist answered for one configuration, the scorecard, per-class and
per-tenant fairness, what each burst did, the plots and loom diagnose's findings.
"""

from __future__ import annotations

import base64
import html
import re
import shutil
import tempfile
from pathlib import Path

from loom.bench.checklist import Answer, answer
from loom.bench.diagnose import diagnose
from loom.bench.fairness import fairness
from loom.bench.overload import PHASES, burst_outcomes
from loom.bench.plots import plot_fairness, plot_sweeps, plot_timeline
from loom.bench.scorecard import (
    class_rows,
    difference_rows,
    markdown_table,
    rows,
    shown_label,
)
from loom.workload.results import RunResult, groups, load_result
from loom.workload.slo import Slo, parse_slo

Table = list[dict[str, str]]
Named = list[tuple[str, list[RunResult]]]


def write_decision_report(path: Path, slo: Slo | None = None,
                          gpu_cost_per_hour: float | None = None,
                          main: str | None = None) -> tuple[Path, Path]:
    """Write report.html and report.md into the compare directory `path` (or beside a result
    file); returns their paths."""
    obj = load_result(path)
    out_dir = path if path.is_dir() else path.parent
    grouped = groups(obj)
    runs = [run for _, rs, _ in grouped for run in rs]
    if slo is None:
        slo = parse_slo(next((r.slo for r in runs if r.slo), None))
    chosen, answers = answer(grouped, main, slo, gpu_cost_per_hour)
    named = [(name, rs) for name, rs, _ in grouped]
    sections = [
        ("Scorecard", rows(runs, slo, gpu_cost_per_hour)),
        ("Differences against the first configuration (repeats)", difference_rows(named)),
        ("Per request class", class_rows(runs, slo)),
        ("Fairness (slowdown = E2E / ideal; Jain's index: 1 = fair)", fairness_rows(named)),
        ("Bursts", burst_rows(runs, slo)),
        ("loom diagnose", [{"Finding": f.title, "Run": f.run, "Measured": f.message,
                            "Try": f.setting} for f in diagnose(obj, slo)]),
    ]
    plots = _plots(named, out_dir)
    context = _context(runs, chosen, slo)
    md_path, html_path = out_dir / "report.md", out_dir / "report.html"
    md_path.write_text(_markdown(chosen, answers, sections, plots, context))
    html_path.write_text(_html(chosen, answers, sections, plots, context))
    return html_path, md_path


def fairness_rows(named: Named) -> Table:
    out = []
    for name, runs in named:
        f = fairness([r for run in runs for r in run.requests])
        if f is None:
            continue
        for kind, by, index in (("class", f.by_class, f.jain_class),
                                ("tenant", f.by_tenant, f.jain_tenant)):
            for group, g in by.items():
                out.append({"Configuration": name, kind.title(): group,
                            "Requests": str(g.requests), "mean slowdown": _x(g.mean_slowdown),
                            "p95 slowdown": _x(g.p95_slowdown), f"Jain ({kind})": _x(index)})
    return out


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def burst_rows(runs: list[RunResult], slo: Slo | None) -> Table:
    out = []
    for run in runs:
        o = burst_outcomes(run, slo)
        if o is None:
            continue
        for phase in PHASES:
            p = getattr(o, phase)
            out.append({"Run": shown_label(run), "Phase": phase, "Sent": str(p.sent),
                        "Answered": str(p.completed), "Refused": str(p.rejected),
                        "Timed out": str(p.timeouts), "Cancelled": str(p.cancelled),
                        "Errors": str(p.errors),
                        "p95 TTFT s": "-" if p.p95_ttft_ms is None
                        else f"{p.p95_ttft_ms / 1000:.2f}",
                        "Response": o.response if phase == "during" else "",
                        "Recovery s": ("-" if o.recovery_s is None
                                       else f"{o.recovery_s:.1f}") if phase == "after" else "",
                        "Paid most": o.paid.get("class", "-") if phase == "during" else ""})
    return out


def _plots(named: Named, out_dir: Path) -> list[tuple[str, Path]]:
    """(title, PNG) of every plot: throughput and latency against load, fairness per class,
    one timeline per configuration; written beside the report as report-*.png."""
    plots = []
    with tempfile.TemporaryDirectory() as tmp:  # not over the compare's own plots
        paths = plot_sweeps(dict(named), Path(tmp))
        for path, title in zip(paths, ("Throughput vs offered load", "Tail latency vs load")):
            plots.append((title, Path(shutil.move(path, out_dir / f"report-{path.name}"))))
    slowdowns = {}
    for name, runs in named:
        f = fairness([r for run in runs for r in run.requests])
        if f:
            slowdowns[name] = {c: g.mean_slowdown for c, g in f.by_class.items()
                               if g.mean_slowdown is not None}
    if path := plot_fairness(slowdowns, out_dir / "report-fairness.png"):
        plots.append(("Slowdown per request class", path))
    for name, runs in named:
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        if path := plot_timeline(name, runs, out_dir / f"report-timeline-{safe}.png"):
            plots.append((f"Timeline: {name}", path))
    return plots


def _context(runs: list[RunResult], chosen: str, slo: Slo | None) -> list[str]:
    first = runs[0]
    hw = first.origin.hardware
    dates = sorted(d for r in runs for d in [r.origin.date]
                   + [f.get("date") for f in r.repeat_figures] if d)
    trace = first.trace
    return [f"Decided on: {chosen}",
            f"SLO: {slo}" if slo else "SLO: none given (latency not judged)",
            f"Trace: {trace.path} (sha256 {trace.sha256}, {trace.num_requests} requests)",
            f"Host: {hw.get('cpu_model', '?')}, {hw.get('cpu_count', '?')} CPUs, "
            f"{(hw.get('ram_bytes') or 0) / 2**30:.0f} GiB RAM, "
            f"{len(hw.get('gpus') or [])} GPUs",
            f"Measured: {dates[0]} to {dates[-1]}" if dates else "Measured: ?",
            "Simulated figures included" if any(r.simulated for r in runs)
            else "All figures measured"]


def _checklist_table(answers: list[Answer]) -> Table:
    return [{"#": str(i), "Question": a.question, "Answer": a.status, "Numbers": a.numbers}
            for i, a in enumerate(answers, 1)]


def _markdown(chosen: str, answers: list[Answer], sections: list[tuple[str, Table]],
              plots: list[tuple[str, Path]], context: list[str]) -> str:
    parts = [f"# Decision report: {chosen}", "", *(f"- {line}" for line in context), "",
             "## Decision checklist", "", markdown_table(_checklist_table(answers))]
    for title, table in sections:
        if table:
            parts += ["", f"## {title}", "", markdown_table(table)]
    parts += ["", "## Plots", ""]
    parts += [f"![{title}]({path.name})" for title, path in plots]
    return "\n".join(parts) + "\n"


_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1200px;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.pass{background:#d9f2d9}.fail{background:#f8d7d7}
.not-measured{background:#eee}img{max-width:100%;border:1px solid #ddd;margin:0.5em 0}"""


def _html_table(table: Table, table_id: str) -> str:
    columns = list(dict.fromkeys(k for row in table for k in row))
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = []
    for row in table:
        cells = []
        for c in columns:
            value = row.get(c, "-")
            css = f' class="{value.replace(" ", "-")}"' if c == "Answer" else ""
            cells.append(f"<td{css}>{html.escape(value)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>'
            + "".join(body) + "</tbody></table>")


def _html(chosen: str, answers: list[Answer], sections: list[tuple[str, Table]],
          plots: list[tuple[str, Path]], context: list[str]) -> str:
    parts = [f"<h1>Decision report: {html.escape(chosen)}</h1><ul>"]
    parts += [f"<li>{html.escape(line)}</li>" for line in context]
    parts += ["</ul><h2>Decision checklist</h2>",
              _html_table(_checklist_table(answers), "checklist")]
    for title, table in sections:
        if table:
            slug = re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")
            parts += [f"<h2>{html.escape(title)}</h2>", _html_table(table, slug)]
    parts.append("<h2>Plots</h2>")
    for title, path in plots:
        data = base64.b64encode(path.read_bytes()).decode()
        parts.append(f'<figure class="plot"><img alt="{html.escape(title)}" '
                     f'src="data:image/png;base64,{data}"><figcaption>{html.escape(title)}'
                     "</figcaption></figure>")
    return ("<!DOCTYPE html><html><head><meta charset=\"utf-8\">"
            f"<title>Decision report: {html.escape(chosen)}</title><style>{_STYLE}</style>"
            f'</head><body data-plots="{len(plots)}">' + "".join(parts) + "</body></html>\n")
