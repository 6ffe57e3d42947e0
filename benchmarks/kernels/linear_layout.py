"""Weight layout for the projection matmuls: plain weights through `F.linear` (MKL re-packs the
weight on every call) against weights prepacked once for oneDNN (`loom.model.linear`), on the
bundled model's own fp32 weights. Run from the repository root:

    python benchmarks/kernels/linear_layout.py

One "chain" is every projection of one step in model order: per layer qkv, o, gate_up, down,
then lm_head (only for M <= 256: a prefill computes logits for a few rows, not all), each at M
rows, so weights stream from memory as in a real step. Layouts alternate within each round;
each figure is the best of --rounds. A second table shows the packed layout's batch hint. A
third puts loom's native kernel on the GGUF's own Q4_1/Q8_0 blocks (`--linear-backend native`,
auto on CPU float32) next to the prepacked layout, at every row count, by path: int8
activations (what the engine runs up to `INT8_MAX_ROWS` rows, by code width) and fp32, with
the GB/s of panel bytes each streams, and the chain as the engine runs it. With --against REV,
the kernel and layout of git revision REV are built too and timed in the same rounds, for a
before/after ratio, and their outputs compared bit for bit:

    python benchmarks/kernels/linear_layout.py --native-only --against 2bb86b4
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.harness import host_line, timings  # noqa: E402

# isort: split
import torch  # noqa: E402
from torch.utils.cpp_extension import load  # noqa: E402

from benchmarks.kernels.decode_kernel import csrc_at  # noqa: E402
from loom import LLM  # noqa: E402
from loom.bench.sysinfo import hardware  # noqa: E402
from loom.model.linear import INT8_MAX_ROWS, Linear  # noqa: E402
from loom.model.loader import load_model  # noqa: E402
from loom.model.weights import BlockQuantWeight  # noqa: E402


def chain_ms(linears: list[Linear], m: int, rounds: int) -> float:
    inputs = {k: torch.randn(m, k) for k in {lin.in_features for lin in linears}}

    def step() -> None:
        for lin in linears:
            lin(inputs[lin.in_features])

    # the best of `rounds` after a warm-up: other load, or a garbage collection, lands in some
    return min(timings(step, rounds)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,8,32,64,256,512,1024,2048")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--native-rows", default="1,2,4,8,16,24,32,64,128,512")
    parser.add_argument("--native-only", action="store_true", help="only the third table")
    parser.add_argument("--against", help="also time the native kernel of this git revision")
    args = parser.parse_args()
    print(host_line())
    if args.native_only:
        with torch.inference_mode():
            native_table(args.native_rows, args.rounds, args.against)
        return
    model = LLM(dtype="float32", linear_backend="torch").engine.runner.model
    weights = [lin.weight for layer in model.layers
               for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    lm_head = model.lm_head.weight

    def linears(prepack: bool, hint: int | None = None, with_head: bool = True) -> list[Linear]:
        out = [Linear(w, prepack=prepack) for w in weights + ([lm_head] if with_head else [])]
        if hint is not None:  # re-pack with another batch hint
            for lin, w in zip(out, weights + [lm_head]):
                lin.weight = torch.ops.mkldnn._reorder_linear_weight(w, hint)
        return out

    hw = hardware()
    print(f"{hw['cpu_model']}, {hw['cpus_usable']} CPUs, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads\n")
    print("| M | F.linear ms | prepacked ms | speed-up |\n|--:|--:|--:|--:|")
    with torch.inference_mode():
        for m in map(int, args.rows.split(",")):
            plain, packed = linears(False, with_head=m <= 256), linears(True, with_head=m <= 256)
            t_plain = t_packed = float("inf")
            for _ in range(args.rounds):
                t_plain = min(t_plain, chain_ms(plain, m, 1))
                t_packed = min(t_packed, chain_ms(packed, m, 1))
            print(f"| {m} | {t_plain:.1f} | {t_packed:.1f} | {t_plain / t_packed:.2f}x |")
        print("\nBatch hint of the packed layout (ms per chain):\n")
        print("| M | hint 1 | hint 32 | hint 512 |\n|--:|--:|--:|--:|")
        for m in (8, 64, 512):
            row = [chain_ms(linears(True, hint), m, args.rounds) for hint in (1, 32, 512)]
            print(f"| {m} | " + " | ".join(f"{t:.1f}" for t in row) + " |")
        native_table(args.native_rows, args.rounds, args.against)


def model_chain(model) -> list[Linear]:
    return [lin for layer in model.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)] + [model.lm_head]


class OnPath:
    """A native Linear's kernel call with the path forced: int8 activations up to int8_rows
    rows, fp32 above."""

    def __init__(self, linear: Linear, int8_rows: int) -> None:
        self.linear, self.int8_rows, self.in_features = linear, int8_rows, linear.in_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lin = self.linear
        return lin._block_quant_ops.block_quant_linear(x, lin.panels, lin.bias, self.int8_rows)


def linears_at(rev: str) -> list[Linear]:
    """The bundled model's chain on the native kernel and layout (model/linear.py) of git
    revision `rev`, each compiled or imported from that revision's source."""
    def show(path: str) -> str:
        return subprocess.run(["git", "show", f"{rev}:{path}"], check=True,
                              capture_output=True, text=True).stdout

    folder = csrc_at(rev, "block_quant_linear.cpp")
    ops = load(name=f"loom_block_quant_linear_{rev}",
               sources=[str(folder / "block_quant_linear.cpp")],
               extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffast-math"],
               extra_ldflags=["-fopenmp"])
    old = types.ModuleType(f"linear_{rev}")
    exec(compile(show("src/loom/model/linear.py"), f"{rev}:linear.py", "exec"), old.__dict__)
    loaded = load_model(None)
    bq = loaded.block_quant
    names = []
    for i in range(loaded.arch.num_layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        names += [[attn + f"{x}_proj.weight" for x in "qkv"], [attn + "o_proj.weight"],
                  [mlp + "gate_proj.weight", mlp + "up_proj.weight"], [mlp + "down_proj.weight"]]
    head = "model.embed_tokens.weight" if loaded.arch.tie_word_embeddings else "lm_head.weight"
    return [old.Linear(None, None, False, BlockQuantWeight.cat([bq[n] for n in group]), ops)
            for group in names + [[head]]]


def panel_bytes(linears: list) -> int:
    return sum(t.numel() * t.element_size()
               for lin in linears for t in (lin.panels if isinstance(lin.panels, tuple)
                                           else (lin.panels,)))


def same_outputs(new: list[Linear], old: list, m: int) -> str:
    """"yes" if every projection of the chain gives bit-identical outputs (torch.equal) on
    both kernels at m rows, each on the path its engine takes there, else "no"."""
    for a, b in zip(new, old, strict=True):
        x = torch.randn(m, a.in_features)
        if not torch.equal(a(x), b(x)):
            return "no"
    return "yes"


def native_table(rows: str, rounds: int, against: str | None) -> None:
    layers = model_chain(LLM(dtype="float32", linear_backend="native").engine.runner.model)
    packed = model_chain(LLM(dtype="float32", linear_backend="onednn").engine.runner.model)
    old = linears_at(against) if against else None
    paths = {"int8": [OnPath(lin, 1 << 30) for lin in layers],
             "fp32": [OnPath(lin, 0) for lin in layers],
             "engine": layers}  # each layer on the path the engine picks for its code width
    new_gb = panel_bytes(layers) / 1e9
    print(f"\nNative kernel on the GGUF's blocks ({new_gb * 1e3:.0f} MB of panels) by path, "
          f"against the prepacked layout (ms per chain; the engine takes int8 up to "
          f"{INT8_MAX_ROWS[4]} rows for 4-bit codes and {INT8_MAX_ROWS[8]} for 8-bit ones):\n")
    extra = ""
    if old is not None:
        old_gb = panel_bytes(old) / 1e9
        print(f"{against}: its kernel and layout ({old_gb * 1e3:.0f} MB of panels).\n")
        extra = (f" {against} ms | {against} GB/s | speed-up vs {against} | outputs equal to "
                 f"{against}'s |")
    print(f"| M | prepacked ms | int8 ms | int8 GB/s | fp32 ms | engine vs prepacked |{extra}\n"
          "|--:|--:|--:|--:|--:|--:|" + ("--:|--:|--:|:-:|" if old else ""))
    for m in map(int, rows.split(",")):
        chains = {"prepacked": packed, **paths, **({"old": old} if old else {})}
        best = dict.fromkeys(chains, float("inf"))
        for _ in range(rounds):  # the chains alternate within each round
            for name, chain in chains.items():
                best[name] = min(best[name], chain_ms(chain, m, 1))
        t_new = best["engine"]
        row = (f"| {m} | {best['prepacked']:.1f} | {best['int8']:.1f} | "
               f"{new_gb / best['int8'] * 1e3:.1f} | {best['fp32']:.1f} | "
               f"{best['prepacked'] / t_new:.2f}x |")
        if old is not None:
            row += (f" {best['old']:.1f} | {old_gb / best['old'] * 1e3:.1f} | "
                    f"{best['old'] / t_new:.2f}x | {same_outputs(layers, old, m)} |")
        print(row, flush=True)


if __name__ == "__main__":
    main()
