"""Deferred torch modules (loom.torch_import): a process that is loom's own imports torch
without running its meta registrations and exporter, computes the same, and still gets the
whole of torch the moment something asks for it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from loom import LLM, SamplingParams
from loom.torch_import import DEFERRED_MODULES

DEFER_AND_IMPORT = ("import json, sys; from loom import torch_import as t; "
                    "assert t.defer_unused_modules(); import torch\n")


def run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON object last."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.unit
def test_deferred_modules_wait_and_eager_torch_works_without_them() -> None:
    result = run_python(DEFER_AND_IMPORT + (
        "before = t.still_deferred()\n"
        "meta = list((torch.ones(2, 3, device='meta') @ torch.ones(3, 4, device='meta')).shape)\n"
        "x = torch.arange(6.0).reshape(2, 3)\n"
        "value = torch.nn.functional.softmax(x @ x.T, dim=-1).sum().item()\n"
        "seeded = torch.rand(3, generator=torch.Generator().manual_seed(7)).tolist()\n"
        "print(json.dumps({'before': before, 'after': t.still_deferred(), 'meta': meta, "
        "'value': value, 'seeded': seeded, 'prims': 'torch._prims' in sys.modules}))"))
    assert sorted(result["before"]) == sorted(DEFERRED_MODULES)
    assert sorted(result["after"]) == sorted(DEFERRED_MODULES)  # eager ops never ran them
    assert result["meta"] == [2, 4]
    assert result["value"] == pytest.approx(2.0)
    # torch.Generator needs a metaclass the meta registrations' imports set: set without them
    assert result["seeded"] == torch.rand(3, generator=torch.Generator().manual_seed(7)).tolist()
    assert result["prims"] is False


@pytest.mark.unit
def test_torch_export_and_compile_still_work_and_run_every_deferred_module() -> None:
    result = run_python(DEFER_AND_IMPORT + (
        "class Double(torch.nn.Module):\n"
        "    def forward(self, x): return x * 2\n"
        "program = torch.export.export(Double(), (torch.ones(3),))\n"
        "after_export = t.still_deferred()\n"
        "compiled = torch.compile(lambda x: (x * 2).sin().sum(), backend='eager')\n"
        "value = compiled(torch.zeros(4)).item()\n"
        "print(json.dumps({'export': type(program).__name__, 'after': after_export, "
        "'value': value}))"))
    assert result == {"export": "ExportedProgram", "after": [], "value": 0.0}


@pytest.mark.unit
def test_compile_alone_runs_the_meta_registrations_first() -> None:
    """Nothing reads an attribute of torch._meta_registrations; importing the compiler must
    run it anyway, or fake tensors would miss its kernels."""
    result = run_python(DEFER_AND_IMPORT + (
        "import torch._dynamo\n"
        "print(json.dumps({'after': t.still_deferred()}))"))
    assert result == {"after": []}


@pytest.mark.unit
def test_nothing_is_deferred_once_torch_is_imported() -> None:
    result = run_python(
        "import json, sys, torch; from loom import torch_import as t\n"
        "print(json.dumps({'done': t.defer_unused_modules(), "
        "'deferred': t.still_deferred()}))")
    assert result == {"done": False, "deferred": []}


@pytest.mark.integration
def test_the_loom_command_defers_them_and_generates_what_the_whole_torch_does(
        llm: LLM) -> None:
    """`loom generate` (the engine in the command's own process) against the session's LLM,
    which runs on a torch imported whole."""
    prompt = "The capital of France is"
    expected = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0))
    result = run_python(
        "import contextlib, io, json\n"
        "from loom.cli.main import main\n"
        "from loom import torch_import as t\n"
        "out = io.StringIO()\n"
        "with contextlib.redirect_stdout(out):\n"
        f"    code = main(['generate', {prompt!r}, '--no-chat', '--max-tokens', '12', "
        "'--temperature', '0', '--dtype', 'float32', '--kv-cache-memory', '64MiB', "
        "'--max-model-len', '1024'])\n"
        "print(json.dumps({'code': code, 'text': out.getvalue(), "
        "'deferred': t.still_deferred()}))")
    assert result["code"] == 0
    assert sorted(result["deferred"]) == sorted(DEFERRED_MODULES)
    text = expected[0].outputs[0].text.strip()
    assert len(text) > 5 and text in result["text"]
