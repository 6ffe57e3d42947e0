"""Two source trees' native block-quantized matmul (csrc/block_quant_linear.cpp) side by side
in one process: the matmuls of one decode step on the bundled model's own weights, or a
GGUF's (`--model`; so they stream from memory, as in a real step), at a few row counts, the
builds alternating many times. A kernel change is a few percent of a step; runs in separate
processes, minutes apart, spread more than that on a shared machine. Run from the repository
root, e.g.:

    git worktree add /tmp/before HEAD~1
    python benchmarks/kernels/matmul_builds.py --tree before=/tmp/before --tree after=. --rows 1 8

Each tree's csrc/block_quant_linear.cpp is compiled with loom's flags under a module name of
its own (two extensions of one name share one module object in a process), about half a
minute each, into a temporary folder; the model, its weight panels and the inputs are this
checkout's, shared by both builds, so the builds must agree on the panel layout.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from types import ModuleType

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
from benchmarks.engine.roofline import measure_matmul_step  # noqa: E402
from benchmarks.harness import host_line, medians, round_order  # noqa: E402
from loom import LLM  # noqa: E402
from loom.model import kernels  # noqa: E402
from loom.model.linear import Linear  # noqa: E402


def build(label: str, tree: Path, directory: Path) -> ModuleType:
    """The tree's matmul extension, compiled as `loom_block_quant_linear_<label>`, on this
    process's pool of helper threads."""
    from torch.utils.cpp_extension import load

    name = f"loom_block_quant_linear_{label}"
    (directory / name).mkdir(parents=True)
    module = load(name=name, sources=[str(tree / "src/loom/model/csrc/block_quant_linear.cpp")],
                  build_directory=str(directory / name), extra_cflags=kernels._CFLAGS,
                  extra_ldflags=kernels._LDFLAGS)
    return kernels._join_pool(module)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", action="append", required=True, metavar="LABEL=DIR")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=5, help="steps timed per round (median)")
    parser.add_argument("--model", default=None, help="a GGUF (default: the bundled model)")
    args = parser.parse_args()
    model = LLM(**({"model": args.model} if args.model else {}),  # this tree's build first
                kv_cache_memory="256MiB").engine.runner.model
    with tempfile.TemporaryDirectory() as directory:
        builds = {label: build(label, Path(tree), Path(directory)) for label, tree in
                  (spec.split("=", 1) for spec in args.tree)}
    linears = [lin for lin in [model.lm_head, *(getattr(layer, name) for layer in model.layers
                                                for name in ("qkv", "o", "gate_up", "down"))]
               if isinstance(lin, Linear) and lin.panels is not None]
    times: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for label in round_order(list(builds), r):
            for lin in linears:
                lin._block_quant_ops = builds[label]
            for rows in args.rows:
                times.setdefault((label, rows), []).append(
                    measure_matmul_step(model, rows, args.repeats))
    first = next(iter(builds))
    print(f"{host_line()}; {args.rounds} rounds, builds alternating; median ms of the "
          f"step's matmuls\n")
    print("| rows | " + " | ".join(f"{label} ms" for label in builds) + " | "
          + " | ".join(f"{label} / {first}" for label in list(builds)[1:]) + " |")
    print("|--:|" + "--:|" * (2 * len(builds) - 1))
    for rows in args.rows:
        ms = {label: 1e3 * m for label, m in
              medians({label: times[(label, rows)] for label in builds}).items()}
        ratios = [f"{ms[label] / ms[first]:.3f}" for label in list(builds)[1:]]
        print(f"| {rows} | " + " | ".join(f"{v:.2f}" for v in ms.values()) + " | "
              + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
