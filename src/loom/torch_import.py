"""Importing torch without the parts a serving process never runs.

`import torch` runs every one of its submodules' top levels, and on a small CPU that is most of
the time `loom serve` takes to start. Three of the largest serve compilers and exporters only:

- `torch._meta_registrations` and `torch.distributed._meta_registrations` register Python
  "meta" kernels, which compute output shapes for fake tensors (torch.compile, torch.export).
  Eager kernels, which are all loom runs, never call them.
- `torch.export`, the exporter.

In a process that is loom's own (the `loom` command, the engine process) `defer_unused_modules`
makes these *deferred*: importing one puts a module in sys.modules that has its name, file and
package path but has not run. Its code runs, in that same module object, the first time
anything reads any other attribute of it, so a program that does use torch.export gets the
whole of it, only later. Nobody reads the meta registrations in loom, so they never run.

`import loom` does not do this: a program that uses loom as a library and compiles its own
models with torch.compile needs the meta kernels registered as torch registers them.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import threading
import types
from collections.abc import Callable
from typing import Any


def _set_generator_metaclass() -> None:
    """What torch.Generator needs of the meta registrations' imports: torch._C leaves the
    Generator's metaclass to torch._prims.rng_prims, which torch imports on its way to the
    meta registrations; that module imports all of torch._prims (its fake tensors, its
    decompositions), one of the larger parts of torch's import. Where this torch lacks the
    hook, rng_prims itself."""
    import torch

    set_metaclass = getattr(torch._C, "_set_generator_metaclass", None)
    if set_metaclass is None:
        importlib.import_module("torch._prims.rng_prims")
        return
    from torch._opaque_base import OpaqueBaseMeta

    set_metaclass(OpaqueBaseMeta)


# In the order torch imports them; the first use of any runs them all in this order, as torch
# would have (torch.export's later imports count on the meta registrations' having run). With
# each, what torch needs of it in any case, done in its place (rng_prims sets the metaclass
# again, and registers the Generator for torch.compile, when the registrations do run).
_DONE_IN_PLACE: dict[str, Callable[[], None] | None] = {
    "torch.export": None,
    "torch.distributed._meta_registrations": None,
    "torch._meta_registrations": _set_generator_metaclass,
}
DEFERRED_MODULES = tuple(_DONE_IN_PLACE)

# Importing one of these runs the deferred modules first: torch.compile's fake tensors need the
# meta kernels registered, though nothing reads an attribute of the module that registers them.
_RUN_BEFORE = frozenset({"torch._dynamo", "torch._inductor"})

_run_lock = threading.RLock()  # one thread runs a deferred module; the others wait for it


class DeferredModule(types.ModuleType):
    """A module whose code runs on the first read of an attribute it does not have yet.
    Dunder look-ups (inspect and the import system probe `__file__`, `__path__`, ...) do not
    count: they answer from what the module has, as a module being imported would."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        run_deferred_modules()
        return object.__getattribute__(self, name)


class _DeferringLoader:
    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        if (needed := _DONE_IN_PLACE[spec.name]) is not None:
            needed()
        module = DeferredModule(spec.name)
        module.__dict__.update(_loom_ran=False, _loom_loader=self._loader)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        """Run nothing yet (DeferredModule.__getattr__ does, on first use); hand the module
        its real loader, which tracebacks and source look-ups ask for."""
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader


class _DeferringFinder:
    """Finds the deferred modules where the normal path finder does, with a loader that
    defers them."""

    def find_spec(self, name: str, path: Any = None,
                  target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name in _RUN_BEFORE:
            run_deferred_modules()
        if name not in DEFERRED_MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _DeferringLoader(spec.loader)
        return spec


def defer_unused_modules() -> bool:
    """Defer DEFERRED_MODULES for the torch this process will import. False (and nothing
    done) if torch is imported already; idempotent."""
    if "torch" in sys.modules:
        return False
    if not any(isinstance(finder, _DeferringFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _DeferringFinder())
    return True


def run_deferred_modules() -> None:
    """Run every deferred module that has not run, in torch's order."""
    with _run_lock:
        for name in DEFERRED_MODULES:
            module = sys.modules.get(name)
            if isinstance(module, DeferredModule) and not module.__dict__["_loom_ran"]:
                module.__dict__["_loom_ran"] = True
                module.__dict__["_loom_loader"].exec_module(module)


def still_deferred() -> list[str]:
    """The DEFERRED_MODULES imported deferred that have not run yet, in torch's order."""
    return [name for name in DEFERRED_MODULES
            if isinstance(module := sys.modules.get(name), DeferredModule)
            and not module.__dict__["_loom_ran"]]
