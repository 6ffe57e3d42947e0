"""The import rules of docs/architecture.md, enforced: each arrow between the layers points one
way, so the scheduler can be driven without a model, and `loom bench` works against servers
that are not loom (and without torch)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

SRC = Path(__file__).resolve().parent.parent / "src" / "loom"

# package -> loom modules (prefixes) it must never import, at any depth of its code
FORBIDDEN = {
    "core": ["loom.model", "loom.engine", "loom.entrypoints", "loom.bench", "loom.sim",
             "loom.plan", "loom.cluster"],
    "model": ["loom.core.scheduler", "loom.core.static", "loom.core.kv_cache",
              "loom.core.block_pool", "loom.engine", "loom.entrypoints", "loom.bench"],
    "engine": ["loom.entrypoints", "loom.bench", "loom.sim", "loom.plan"],
    "bench": ["loom.engine", "loom.entrypoints", "loom.model.runner", "loom.model.decoder",
              "loom.model.loader", "loom.model.linear", "loom.model.attention",
              "loom.model.kernels", "loom.model.backends", "loom.model.weights"],
    "cluster": ["loom.entrypoints", "loom.bench", "loom.sim", "loom.plan"],
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


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    violations = []
    for path in sorted((SRC / package).rglob("*.py")):
        for line, module in imports_of(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[package]):
                violations.append(f"{path.relative_to(SRC.parent)}:{line} imports {module}")
    assert not violations, "\n".join(violations)


def test_the_rule_checker_sees_function_level_imports(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from loom.engine.core import EngineCore\n")
    assert (2, "loom.engine.core.EngineCore") in imports_of(module)


def test_the_scheduler_and_engine_loop_load_without_the_model_code() -> None:
    """core/, engine/ and the simulator never pull in the model runner, nor torch: a stand-in
    runner (tests, `loom simulate`) can drive them on a machine without either."""
    code = ("import sys, loom.engine.core, loom.core.scheduler, loom.sim.engine; "
            "print(any(m.startswith('loom.model.') and m not in "
            "('loom.model.arch', 'loom.model.tokenizer', 'loom.model.gguf_file', "
            "'loom.model.memory') "
            "for m in sys.modules), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split() == ["False", "False"]
