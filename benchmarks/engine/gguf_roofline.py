"""How near one user's decode runs to this host's memory-bandwidth roofline, for a GGUF.

One decode token must read every weight a token uses once: llama.cpp reads the file's own
blocks (every tensor but the token embeddings, which it looks rows up in, unless tied: then
they are the output layer too), loom the form it holds them in (its native kernel's panels:
Q4_K and Q6_K in records of their own, 4.625 and 6.625 bits a weight), so the two read different
byte counts from the same file. roofline ITL = bytes / the host's best read bandwidth
(roofline.measure_bandwidth, STREAM-like, every core); the fraction = roofline ITL / the
measured one. Dense models only (a mixture's token reads its experts only). Run from the
repository root, with the p95 or median ITLs a peers.py run measured:

    python benchmarks/engine/gguf_roofline.py --gguf qwen3-8b-Q4_K_M.gguf \\
        --itl-ms loom=250 llama.cpp=240
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: benchmarks.*
import loom  # noqa: F401, E402 - before torch: it sets the OpenMP wait policy (loom/threads.py)
from benchmarks.engine.roofline import measure_bandwidth, model_figures  # noqa: E402
from benchmarks.harness import host_line  # noqa: E402

# isort: split
import gguf  # noqa: E402
import torch  # noqa: E402

from loom import LLM  # noqa: E402


def file_bytes_per_token(path: str) -> int:
    """The bytes of the file's tensors a decode token reads (llama.cpp's view)."""
    tensors = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    tied = "output.weight" not in tensors
    return sum(n for name, n in tensors.items() if tied or name != "token_embd.weight")


def loom_bytes_per_token(path: str) -> int:
    """The bytes of the weights loom holds for a decode token (its panels, norms, lm_head)."""
    llm = LLM(model=path, kv_cache_memory="256MiB", max_num_seqs=1)
    runner = llm.engine.runner
    figures = model_figures(runner.model, runner.kv_caches[0][0].dtype)
    return figures["block_quant_weight_bytes"] or figures["weight_bytes"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--itl-ms", nargs="*", default=[], metavar="SERVER=MS",
                        help="measured ITLs at one user, e.g. loom=250 llama.cpp=240")
    args = parser.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    print(host_line(), flush=True)
    read_gbs = measure_bandwidth(2**30, 7)["read_best_gbs"]
    reads = {"llama.cpp": file_bytes_per_token(args.gguf), "loom": loom_bytes_per_token(args.gguf)}
    print(f"read bandwidth (best of 7, 1 GiB): {read_gbs:.1f} GB/s")
    for server, nbytes in reads.items():
        print(f"{server}: {nbytes / 1e9:.2f} GB a token, roofline ITL "
              f"{nbytes / read_gbs / 1e6:.0f} ms")
    for item in args.itl_ms:
        server, ms = item.split("=")
        bound_ms = reads[server] / read_gbs / 1e6
        print(f"{server}: measured ITL {float(ms):.0f} ms = {bound_ms / float(ms):.0%} of its "
              "roofline")


if __name__ == "__main__":
    main()
