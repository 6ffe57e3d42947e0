"""The import rules of docs/architecture.md, enforced: each arrow between the layers points one
way (no module reaches, however indirectly, back to itself), so the scheduler can be driven
without a model, `loom bench` works against servers that are not loom (and without torch),
and the command line sits on top of libraries that take dataclasses, never an argv."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parent.parent / "src" / "loom"

# loom.model modules bench, workload and plan may read: torch-free
TORCH_FREE_MODEL = ("loom.model.arch", "loom.model.arch_gguf", "loom.model.arch_hf",
                    "loom.model.model_files", "loom.model.gguf_file", "loom.model.tokenizer",
                    "loom.model.gguf_vocab", "loom.model.chat_template",
                    "loom.model.generation_config", "loom.model.memory")
MODEL_WITH_TORCH = ["loom.model.runner", "loom.model.decoder", "loom.model.loader",
                    "loom.model.linear", "loom.model.attention", "loom.model.kernels",
                    "loom.model.backends", "loom.model.weights", "loom.model.requant",
                    "loom.model.sampler", "loom.model.spec_verify", "loom.model.moe"]

# package -> loom modules (prefixes) it must never import, at any depth of its code
FORBIDDEN = {
    "core": ["loom.model", "loom.engine", "loom.entrypoints", "loom.bench", "loom.sim",
             "loom.plan", "loom.cluster", "loom.workload"],
    "model": ["loom.core.scheduler", "loom.core.static", "loom.core.kv_cache",
              "loom.core.block_pool", "loom.engine", "loom.entrypoints", "loom.bench",
              "loom.workload"],
    "engine": ["loom.entrypoints", "loom.bench", "loom.sim", "loom.plan", "loom.workload"],
    # the vocabulary bench and sim share: no HTTP, no engine, no torch
    "workload": ["loom.bench", "loom.sim", "loom.plan", "loom.engine", "loom.entrypoints",
                 "loom.cluster", "loom.core", "httpx", "torch", *MODEL_WITH_TORCH],
    # talks to servers over HTTP only; never runs the simulator (compare's Measure protocol)
    "bench": ["loom.engine", "loom.entrypoints", "loom.sim", "loom.plan", "loom.cluster",
              "loom.core", "torch", *MODEL_WITH_TORCH],
    # the real scheduler on a virtual clock; never the HTTP side
    "sim": ["loom.bench", "loom.entrypoints", "httpx"],
    "plan": ["loom.bench", "loom.sim", "loom.workload", "loom.engine", "loom.entrypoints",
             "loom.cluster", "loom.core", "torch", *MODEL_WITH_TORCH],
    "cluster": ["loom.entrypoints", "loom.bench", "loom.sim", "loom.plan", "loom.workload"],
    "structured": ["loom.model", "loom.engine", "loom.entrypoints", "torch"],
}
def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, function-level ones included."""
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(SRC.rglob("*.py"))}


def loom_imports(path: Path) -> set[str]:
    """The loom modules a file imports (`from loom.a import b` is loom.a.b where that is a
    module, else loom.a), at module or function level."""
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module in MODULES and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
            out |= {n for n in names if n in MODULES}
            if not all(n in MODULES for n in names):
                out.add(node.module)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), and modules that
    import themselves."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(graph)))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    violations = []
    for path in sorted((SRC / package).rglob("*.py")):
        for line, module in imports_of(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package]):
                violations.append(f"{path.relative_to(SRC.parent)}:{line} imports {module}")
    assert not violations, "\n".join(violations)


def test_no_import_cycles() -> None:
    """Module-level and function-level imports alike: a function-level import that closes a
    cycle is a layering mistake too, only deferred."""
    graph = {name: loom_imports(path) for name, path in MODULES.items()}
    assert cycles(graph) == []


def test_the_cycle_check_finds_a_cycle_through_a_function_level_import() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"a"}}) == [["a"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_nothing_below_the_command_line_imports_it_or_argparse() -> None:
    """cli/ is on top: libraries take dataclasses, never an argparse.Namespace or an argv, and
    no package reaches into another's command line. The package `loom` itself (its public
    names) is for users: loom's own modules import what they need from where it lives."""
    violations = []
    for name, path in MODULES.items():
        rel = str(path.relative_to(SRC.parent))
        if name.startswith("loom.cli") or name == "loom":
            continue
        for line, module in imports_of(path):
            if module == "loom.cli" or module.startswith("loom.cli."):
                violations.append(f"{rel}:{line} imports {module}")
            if module == "argparse":
                violations.append(f"{rel}:{line} imports argparse")
        violations += [f"{rel}:{line} imports the package loom's {name}"
                       for line, name in package_imports(path)]
    assert not violations, "\n".join(violations)


def package_imports(path: Path) -> list[tuple[int, str]]:
    """`import loom`, or a name from loom/__init__.py that is not a module of its own."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, "loom") for a in node.names if a.name == "loom"]
        elif isinstance(node, ast.ImportFrom) and node.module == "loom":
            found += [(node.lineno, a.name) for a in node.names if f"loom.{a.name}" not in MODULES]
    return found


def argv_reads(path: Path) -> list[int]:
    """Lines that read the process's command line: `sys.argv`, or `argv` imported from sys."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Attribute) and node.attr == "argv"
                and isinstance(node.value, ast.Name) and node.value.id == "sys"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "sys":
            lines += [node.lineno for a in node.names if a.name == "argv"]
    return lines


def test_only_the_command_line_reads_sys_argv() -> None:
    """What a result file records as its command is given to the library by cli/ (as
    `command_line()`), so a library called from a script or a test records what it is told."""
    violations = [f"{path.relative_to(SRC.parent)}:{line} reads sys.argv"
                  for name, path in MODULES.items() if not name.startswith("loom.cli")
                  for line in argv_reads(path)]
    assert not violations, "\n".join(violations)


def test_the_argv_check_finds_both_spellings(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("import sys\nfrom sys import argv\n\ndef f():\n    return sys.argv\n")
    assert sorted(argv_reads(module)) == [2, 5]


def test_the_rule_checker_sees_function_level_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from loom.engine.core import EngineCore\n")
    assert (2, "loom.engine.core.EngineCore") in imports_of(module)


MAX_LINES = 400


def test_no_source_file_is_over_400_lines() -> None:
    """Python modules and the C++ kernels' sources and headers alike."""
    kernels = [p for ext in ("cpp", "h") for p in sorted((SRC / "model" / "csrc").glob(f"*.{ext}"))]
    long = [f"{path.relative_to(SRC.parent)}: {n} lines" for path in [*MODULES.values(), *kernels]
            if (n := len(path.read_text().splitlines())) > MAX_LINES]
    assert not long, "\n".join(long)


def test_the_scheduler_and_engine_loop_load_without_the_model_code() -> None:
    """core/, engine/ and the simulator never pull in the model runner, nor torch: a stand-in
    runner (tests, `loom simulate`) can drive them on a machine without either."""
    code = ("import sys, loom.engine.core, loom.core.scheduler, loom.sim.engine; "
            "print(any(m.startswith('loom.model.') and m not in "
            f"{TORCH_FREE_MODEL!r} for m in sys.modules), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]


def test_bench_and_workload_load_without_torch() -> None:
    """`loom bench` benchmarks a remote server from a machine without torch."""
    code = ("import importlib, pkgutil, sys, loom.bench, loom.workload\n"
            "for package in (loom.bench, loom.workload):\n"
            "    for m in pkgutil.iter_modules(package.__path__):\n"
            "        importlib.import_module(f'{package.__name__}.{m.name}')\n"
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False"]


ARCHITECTURE = SRC.parent.parent / "docs" / "architecture.md"


def module_map() -> list[str]:
    """The lines of docs/architecture.md's module map (the code block after its heading)."""
    text = ARCHITECTURE.read_text().split("## Module map", 1)[1]
    return text.split("```", 2)[1].splitlines()


def entry_block(lines: list[str], name: str) -> list[str] | None:
    """The lines of the map's entry for `name` ("core/"): its own and those indented under it;
    None if no entry of `lines` starts with it."""
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if line.lstrip().startswith(name):
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip()
                        and len(lines[j]) - len(lines[j].lstrip()) <= indent), len(lines))
            return lines[i:end]
    return None


def unmapped_files(lines: list[str]) -> list[str]:
    """The files under src/loom (but packages' __init__.py) the map does not name within the
    entry of their folder (or, for a folder without an entry of its own, its parent's)."""
    missing = []
    for path in sorted(p for p in SRC.rglob("*") if p.is_file()):
        relative = path.relative_to(SRC)
        if "__pycache__" in relative.parts or relative.name == "__init__.py":
            continue
        block = lines
        for folder in relative.parts[:-1]:
            block = entry_block(block, f"{folder}/") or block
        if not any(relative.name in line for line in block):
            missing.append(str(relative))
    return missing


def test_the_module_map_names_every_file() -> None:
    """docs/architecture.md is the map a newcomer reads: a file it leaves out is one nobody
    finds, and a file added without a line there fails here."""
    assert unmapped_files(module_map()) == []


def test_the_module_map_check_finds_a_file_named_only_in_another_folder() -> None:
    lines = ["src/loom/", "  core/            the brain", "    scheduler.py   batches",
             "  sim/             a clock", "    engine.py      steps"]
    assert entry_block(lines, "core/") == lines[1:3]
    assert "core/scheduler.py" not in unmapped_files(lines)
    assert "sim/replay.py" in unmapped_files(lines)
    assert "core/block_pool.py" in unmapped_files(lines + ["    block_pool.py  (under sim/)"])
