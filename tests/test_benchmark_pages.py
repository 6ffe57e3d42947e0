"""BENCHMARKS.md, its summaries and the benchmark scripts hold together: every figure a summary
row records is on the page with its commit, every command names a script that exists, every
`benchmarks/...` path and every quoted section the pages and docs point at exists, the pages
stay short, the scripts' imports of each other resolve, and regenerate.sh lists the runs
without running them. What was measured is not checked here (benchmarks are not tests)."""

from __future__ import annotations

import ast
import csv
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
HEADER = ["run", "figure", "value", "command", "commit", "host", "date"]
# The pages that cite benchmark scripts, figures and sections.
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Figure:
    part: str
    run: str
    figure: str
    value: str
    command: str
    commit: str
    host: str
    date: str


def figures() -> list[Figure]:
    rows = []
    for path in sorted((BENCH / "summaries").glob("*.csv")):
        with path.open(newline="") as f:
            reader = csv.reader(f)
            assert next(reader) == HEADER, path
            rows += [Figure(path.stem, *row) for row in reader]
    return rows


def flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_pages_stay_short() -> None:
    assert len((ROOT / "BENCHMARKS.md").read_text().splitlines()) <= 400
    assert len((ROOT / "docs/benchmark-log.md").read_text().splitlines()) < 300


def test_every_summary_row_is_on_the_page_with_its_provenance() -> None:
    page = flat((ROOT / "BENCHMARKS.md").read_text())
    rows = figures()
    assert {row.part for row in rows} >= {"peers", "engine", "server", "planning", "setup"}
    for row in rows:
        assert row.figure and row.value and row.host, row
        assert flat(row.value) in page, f"{row.part}:{row.run}: {row.value!r} not on the page"
        assert re.fullmatch(r"[0-9a-f]{7}", row.commit) and row.commit in page, row
        assert re.fullmatch(r"2026-\d\d-\d\d", row.date) and row.date in page, row
        assert re.match(r".+, \d+ cores, .+, \d+ GiB", row.host), row
        assert f"benchmarks/summaries/{row.part}.csv" in page


def table_figures(markdown: str) -> list[str]:
    """The measured ratios (`1.94x`, `0.38x`) in the cells of a page's tables."""
    rows = [line for line in markdown.splitlines() if line.startswith("|")]
    return [x for row in rows for x in re.findall(r"\b\d+\.\d+x\b", row)]


def test_every_figure_of_the_readme_speed_table_is_on_the_page() -> None:
    """README's "How fast" quotes BENCHMARKS.md's figures: a cell the page does not hold (a
    stale figure, or one never written down with its command) fails here."""
    page = flat((ROOT / "BENCHMARKS.md").read_text())
    speed = (ROOT / "README.md").read_text().split("## How fast", 1)[1].split("\n## ", 1)[0]
    readme = table_figures(speed)
    assert len(readme) >= 16
    assert [x for x in readme if x not in page] == []


def test_every_ratio_the_readme_quotes_is_on_the_page() -> None:
    """Every "1.39x" anywhere in the README (prose too, not only the speed tables) is a figure
    BENCHMARKS.md holds with its command: a README rounding of its own ("about 1.25x") fails."""
    page = flat((ROOT / "BENCHMARKS.md").read_text())
    ratios = set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?x\b", (ROOT / "README.md").read_text()))
    assert len(ratios) >= 40
    assert sorted(x for x in ratios if x not in page) == []


def test_the_table_check_reads_only_table_cells() -> None:
    text = "a 9.99x claim\n| 1 | **1.94x**, 0.38x |\n|--:|--:|"
    assert table_figures(text) == ["1.94x", "0.38x"]


def test_a_run_is_one_command_naming_scripts_that_exist() -> None:
    commands: dict[tuple[str, str], str] = {}
    for row in figures():
        if not row.command:  # a throwaway script's figure: the page says so
            assert not row.run, row
            continue
        assert "\t" not in row.command and "\n" not in row.command
        assert commands.setdefault((row.part, row.run), row.command) == row.command, row
        for script in re.findall(r"benchmarks/[\w/.-]+\.(?:py|sh|jsonl)", row.command):
            assert (ROOT / script).exists(), f"{row.run}: {script}"


def test_every_benchmarks_path_the_pages_name_exists() -> None:
    missing = []
    for page in PAGES:
        for path in re.findall(r"benchmarks/[\w/.-]*\w", page.read_text()):
            if path.startswith("benchmarks/results"):
                continue  # the ignored folder the benchmarks write to
            if not (ROOT / path).exists():
                missing.append(f"{page.name}: {path}")
    assert not missing


def _sections(page: Path) -> list[str]:
    """Headings and bold lead-ins: what a "quoted section" reference can name."""
    text = page.read_text()
    return ([m.strip() for m in re.findall(r"^#+ (.+)$", text, re.M)]
            + re.findall(r"\*\*(.+?)\*\*", text))


def _prose(source: Path) -> str:
    """A file's text with comment markers off its lines, flattened: a reference that wraps
    across comment lines reads as one."""
    return flat(re.sub(r"^[ \t]*(?://+|#+)[ \t]?", "", source.read_text(), flags=re.M))


def test_every_quoted_section_the_code_and_docs_point_at_exists() -> None:
    targets = {"BENCHMARKS": _sections(ROOT / "BENCHMARKS.md"),
               "benchmark-log": _sections(ROOT / "docs/benchmark-log.md")}
    sources = [*PAGES, *ROOT.glob("src/loom/**/*.py"), *ROOT.glob("src/loom/**/*.cpp"),
               *ROOT.glob("src/loom/**/*.h"),
               *(t for t in ROOT.glob("tests/*.py") if t.name != Path(__file__).name)]
    wrong = []
    for source in sources:
        text = _prose(source) if source.suffix != ".md" else flat(source.read_text())
        for page, name in re.findall(r"(BENCHMARKS|benchmark-log)\.md[,\s(]*\"([^\"]+)\"", text):
            if not any(name.rstrip(".") in section for section in targets[page]):
                wrong.append(f"{source.relative_to(ROOT)}: {page}, {name!r}")
    assert not wrong


def _top_level_names(module: Path) -> set[str]:
    names = set()
    for node in ast.parse(module.read_text()).body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def test_the_scripts_imports_of_each_other_resolve() -> None:
    """`python benchmarks/<sub>/<script>.py` imports its neighbours as benchmarks.<sub>.<x>:
    each such import names a module and names in it that exist."""
    for script in (p for p in BENCH.rglob("*.py") if "results" not in p.parts):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks"):
                module = ROOT.joinpath(*node.module.split("."))
                if (module / "__init__.py").exists():
                    assert all((module / f"{a.name}.py").exists() for a in node.names), script
                    continue
                target = module.with_suffix(".py")
                assert target.exists(), (script, node.module)
                missing = {a.name for a in node.names} - _top_level_names(target)
                assert not missing, (script, node.module, missing)


def test_no_raw_results_are_tracked_and_benchmarks_stay_small() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout")
    files = subprocess.run(["git", "ls-files", "-z", "benchmarks"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\0")
    files = [f for f in files if f]
    assert files and not [f for f in files if f.startswith("benchmarks/results/")]
    assert sum((ROOT / f).stat().st_size for f in files if (ROOT / f).exists()) < 2 * 2**20
    ignored = subprocess.run(["git", "check-ignore", "-q", "benchmarks/results/x/log.txt"],
                             cwd=ROOT)
    assert ignored.returncode == 0  # where regenerate.sh and the scripts write


def test_regenerate_lists_every_run_once_and_refuses_an_unknown_one() -> None:
    if shutil.which("bash") is None:
        pytest.skip("no bash")
    script = str(BENCH / "regenerate.sh")
    listed = subprocess.run(["bash", script, "--list"], capture_output=True, text=True,
                            check=True).stdout.splitlines()
    runs = {(row.part, row.run): row.command for row in figures() if row.command}
    assert sorted(listed) == sorted(f"{part}:{run}\t{cmd}" for (part, run), cmd in runs.items())
    one = subprocess.run(["bash", script, "--list", "setup"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert one and all(line.startswith("setup:") for line in one)
    bad = subprocess.run(["bash", script, "--list", "no-such-part"], capture_output=True,
                         text=True)
    assert bad.returncode != 0 and "no-such-part" in bad.stderr
