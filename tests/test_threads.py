"""The CPU thread policy: `import loom` makes sleeping (not spinning) OpenMP waits the default
before torch loads, and keeps whatever the user chose."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

SHOW = "import loom, os, sys; print(os.environ['OMP_WAIT_POLICY'], 'torch' in sys.modules)"


def run(env: dict[str, str]) -> str:
    return subprocess.run([sys.executable, "-c", SHOW], env=env, capture_output=True,
                          text=True, check=True).stdout.strip()


def test_import_loom_defaults_to_passive_waits_before_torch_loads() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert run(env) == "PASSIVE False"


def test_a_policy_the_user_set_is_kept() -> None:
    assert run({**os.environ, "OMP_WAIT_POLICY": "ACTIVE"}) == "ACTIVE False"


def test_configure_threads_sets_and_returns_the_count() -> None:
    import torch

    from loom.threads import configure_threads

    before = torch.get_num_threads()
    try:
        assert configure_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
