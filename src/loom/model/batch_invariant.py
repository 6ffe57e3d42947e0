"""`--batch-invariant`: a request's numerics do not depend on what else shares its steps.

With the defaults a request's logits move in their last bits with the batch: the native
matmul picks its int8 or fp32 path by the call's row count (model/linear.py INT8_MAX_ROWS),
and a prefill chunk attends per token or through SDPA by its size, which the token budget
shared with other requests decides (model/runner.py). A greedy answer near a tie, or a seeded
draw near the boundary between two tokens, then turns. Under the mode:

- every native matmul takes the int8 path whatever its row count: each row's activations are
  quantized by their own blocks and reduced along K in one fixed order, so a row's output is
  the same bit for bit alone, among 300 rows, or in a prefill chunk (tests/test_batch_invariant.py);
- every prompt token attends as a query of its own in the paged decode kernel, over its own
  request's blocks up to its own position, the same sum as a decode step's: chunk boundaries
  (where the shared token budget cuts a prompt) change no number;
- no bf16 copies of the weights, no bf16 attention of long chunks;
- mixture-of-experts layers (model/moe.py) take the native MoE kernel's int8 path for every
  expert, however many of the step's tokens chose it, each token's router logits come from a
  call of its own, and the kernel sums a token's experts in expert order: a token's output is
  that of the token alone;
- sampling needs nothing more: a seeded request draws from its own generator, one number a
  step (model/sampler.py); the add + RMSNorm and SiLU kernels work row by row.

What it refuses rather than half-pins: weights the native kernel does not take (oneDNN's and
MKL's GEMMs block by the row count), experts off the native MoE kernel (the torch loop's
matmuls take the tokens the batch routes to each expert), and attention off the native kernel
(the torch path's SDPA and gather differ).
"""

from __future__ import annotations

from collections.abc import Mapping

# Rows up to which the native kernel takes the int8 path, per code width, under the mode:
# every call (the kernel reads it as a row bound; no batch comes near it).
INT8_EVERY_ROW = {4: 1 << 30, 8: 1 << 30}

# Prefill chunks of fewer query x context positions attend per token: under the mode, all.
PER_TOKEN_EVERY_CHUNK = 1 << 62


def check_supported(linear: str, native_decode: bool) -> None:
    """Raise ValueError, naming what is missing, where the mode cannot pin every source."""
    if linear != "native":
        raise ValueError("batch_invariant needs the native matmul on every projection (a "
                         "GGUF with block-quantized weights, on CPU with AVX2, linear_backend "
                         f"auto or native); this model's matmuls run on {linear!r}, whose "
                         "GEMM blocking follows the row count")
    if not native_decode:
        raise ValueError("batch_invariant needs the native paged attention kernel "
                         "(attention_backend auto or native, block_size 16, head_dim 64 or "
                         "128, float32)")


def pinned(int8_max_rows: Mapping[int, int]) -> bool:
    """Whether a layer's int8 row bounds are the mode's (what the MoE layers check, to take
    their router per token too and to refuse experts off the native kernel)."""
    return dict(int8_max_rows) == INT8_EVERY_ROW


def check_experts_native(native: bool) -> None:
    """Raise ValueError where a mixture-of-experts layer under the mode is off the native kernel."""
    if not native:
        raise ValueError("batch_invariant needs every mixture-of-experts layer on the native "
                         "MoE kernel (block-quantized experts, whole 32-channel blocks, AVX2): "
                         "the torch loop's matmuls take the tokens the batch routes to each expert")
