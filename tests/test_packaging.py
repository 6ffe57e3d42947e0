"""What a wheel of loom carries: the kernels compile on the user's machine at first use, so
every source and header they include must ship, not only the checkout's editable install
(where a missing header goes unnoticed and a wheel's user silently gets the slow torch path)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from loom.model import kernels

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_ships_every_file_the_kernels_compile_from(tmp_path: Path) -> None:
    tree = tmp_path / "tree"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT / "src", tree / "src",
                    ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy(ROOT / name, tree / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(tree)], check=True)
    (wheel,) = (tmp_path / "dist").glob("loom-*.whl")
    shipped = {Path(name).name for name in zipfile.ZipFile(wheel).namelist()
               if "/csrc/" in name}
    needed = {path.name for path in Path(kernels.__file__).parent.joinpath("csrc").iterdir()
              if path.suffix in (".cpp", ".h")}
    assert needed <= shipped, f"not in the wheel: {sorted(needed - shipped)}"
    # and the text `loom eval` scores by default
    assert "loom/eval/data/kjv-genesis-exodus.txt" in zipfile.ZipFile(wheel).namelist()
