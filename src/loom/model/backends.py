"""Where and how the model runs: device, dtype, CPU threads and the kernel behind each op,
resolved once from the config and the machine, then handed to the model and the runner.

Every choice the engine used to make in its constructor lives here, so a newcomer reads the
rule in one place and the engine never probes the machine itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from loom import host
from loom.config import CacheConfig, ModelConfig, check_device
from loom.model import batch_invariant
from loom.model.arch import ModelArch
from loom.model.kernels import block_quant_linear_ops, fused_ops, paged_attention_ops
from loom.model.linear import (
    BF16_ABOVE_ROWS,
    BF16_ABOVE_ROWS_AMX,
    INT8_MAX_ROWS,
    INT8_MAX_ROWS_VNNI,
    MatmulRows,
    amx_kernel_runs,
    onednn_prepack_supported,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# On the native path a prefill chunk of fewer query x context positions than this attends as
# one query per token in the decode kernel (each over the request's blocks up to its own
# position) instead of an SDPA call: a chat prompt's or a follow-up turn's chunk is too small
# for SDPA's fixed cost and its gather of the cached context. The kernel reads the context
# once per tile of a few tokens, SDPA once per chunk, so SDPA can win back long chunks, the
# sooner the faster it is (`benchmarks/kernels/prefill_attention.py --parts per-token`): against
# torch's bf16 SDPA on AMX per-token rows (then read once per token) took under 0.6x its time
# below 2^16 positions and lost from about twice that; against fp32 SDPA (an AVX2 EPYC) the
# tiles took 0.10-0.79x its time at every chunk measured, up to 2,048 tokens after 6,144
# cached (2^24 positions, the largest chunk of the default token budget at an 8K context).
PER_TOKEN_PREFILL_MAX_POSITIONS = 1 << 24
PER_TOKEN_PREFILL_MAX_POSITIONS_BF16 = 1 << 16  # where long chunks attend in bf16

@dataclass(frozen=True)
class Backends:
    device: torch.device
    dtype: torch.dtype
    kv_dtype: torch.dtype  # what the KV cache holds: dtype, or narrower (read as dtype)
    num_threads: int  # torch's intra-op threads on CPU; 0 on GPU
    native_decode: bool  # decode attention through the C++ paged kernel
    linear: str  # projection matmuls: "native" (GGUF blocks), "onednn" (prepacked) or "torch"
    fused_ops: ModuleType | None  # compiled add + RMSNorm and SiLU * up, else torch's ops
    # native: calls of more rows than this in bf16 on copies of the weights (model/linear.py)
    bf16_above_rows: int | None = None
    # long prefill chunks attend in bf16 (model/attention.py, AttentionMetadata.prefill_bf16)
    bf16_prefill_attention: bool = False
    # a request's numerics pinned whatever shares its steps (model/batch_invariant.py)
    batch_invariant: bool = False
    # native: the kernel was built with AVX512-VNNI, so its int8 path takes more rows
    vnni: bool = False

    @property
    def batched_bf16(self) -> bool:
        return self.bf16_above_rows is not None

    @property
    def per_token_prefill_max_positions(self) -> int:
        """Native path: prefill chunks of fewer query x context positions attend per token
        (the runner's choice), fewer where the SDPA they compete with runs in bf16; all of
        them under batch_invariant."""
        if self.batch_invariant:
            return batch_invariant.PER_TOKEN_EVERY_CHUNK
        return (PER_TOKEN_PREFILL_MAX_POSITIONS_BF16 if self.bf16_prefill_attention
                else PER_TOKEN_PREFILL_MAX_POSITIONS)

    @property
    def matmul_rows(self) -> MatmulRows:
        """The native matmul's path by a call's row count."""
        if self.batch_invariant:
            return MatmulRows(None, batch_invariant.INT8_EVERY_ROW)
        return MatmulRows(self.bf16_above_rows,
                          dict(INT8_MAX_ROWS_VNNI if self.vnni else INT8_MAX_ROWS))

    @property
    def prepack(self) -> bool:
        """oneDNN-prepacked fp32 weights: the native matmul keeps them for layers it skips."""
        return self.linear in ("native", "onednn")

    def describe(self) -> str:
        """The start-up log's words for these choices."""
        matmuls = {"native": "native on the GGUF's blocks"
                             + (f", int8 (VNNI) to {INT8_MAX_ROWS_VNNI[4]} rows" if self.vnni
                                else "")
                             + (f", bf16 above {self.bf16_above_rows} rows" if self.batched_bf16
                                else ""),
                   "onednn": "oneDNN prepacked"}
        parts = [f"dtype {str(self.dtype).removeprefix('torch.')}",
                 f"KV cache {str(self.kv_dtype).removeprefix('torch.')}",
                 f"decode attention {'native kernel' if self.native_decode else 'torch'}",
                 f"long prefill attention {'bf16' if self.bf16_prefill_attention else 'as dtype'}",
                 f"matmuls {matmuls.get(self.linear, 'torch')}",
                 f"add + norm and SiLU * up {'fused kernels' if self.fused_ops else 'torch'}"]
        if self.batch_invariant:
            parts.append("batch-invariant (int8 matmuls and per-token attention at every size)")
        if self.num_threads:
            parts.append(f"{self.num_threads} threads")
        return ", ".join(parts)


def resolve_backends(config: ModelConfig, cache: CacheConfig, arch: ModelArch,
                     has_block_quant: bool) -> Backends:
    """The backends for this model on this machine. Raises ValueError when a backend asked
    for by name cannot run here, naming what it needs."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    num_threads = 0
    if device.type == "cpu":
        from loom.threads import configure_threads

        num_threads = configure_threads(config.num_threads)
    kv_dtype = dtype if cache.kv_cache_dtype == "auto" else DTYPES[cache.kv_cache_dtype]
    native_decode = _native_decode(config.attention_backend, arch, cache.block_size, device,
                                   dtype, kv_dtype)
    if cache.kv_cache_dtype == "auto" and native_decode and dtype == torch.float32:
        # the kernel reads an fp16 cache as fp32 (F16C) at the cost of one instruction a
        # vector, and decode attention over long contexts is bound by its reads
        kv_dtype = torch.float16
    linear = _linear_backend(config.linear_backend, has_block_quant, device, dtype)
    fused = fused_ops() if device.type == "cpu" and dtype == torch.float32 else None
    # the casts in and out of bf16 are fused_ops' too
    bf16_above_rows = _bf16_above_rows(config, linear == "native" and fused is not None)
    if config.batch_invariant:
        batch_invariant.check_supported(linear, native_decode)
        bf16_above_rows = None
    return Backends(
        device=device, dtype=dtype, kv_dtype=kv_dtype, num_threads=num_threads,
        native_decode=native_decode, linear=linear, fused_ops=fused,
        bf16_above_rows=bf16_above_rows,
        # where prefill's matmuls already run in bf16, its long attention does too: measured
        # faster on AMX (torch's bf16 SDPA runs on its tiles), not on other CPUs
        bf16_prefill_attention=(bf16_above_rows is not None and dtype == torch.float32
                                and host.has_amx()),
        batch_invariant=config.batch_invariant, vnni=linear == "native" and _kernel_has_vnni())


def _kernel_has_vnni() -> bool:
    ops = block_quant_linear_ops()
    return ops is not None and ops.vnni()


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    check_device(name)  # a sentence where torch would fail deep in its lazy init
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on CUDA, float32 on a CPU. Native bf16 instructions (avx512_bf16, AMX)
    halve a bfloat16 model's weights and speed its prefill, but against float32 it left the
    top-1 prediction at more positions than issue 50's bound allows (top-1 agreement >=
    99%), on the bundled model as a Hugging Face folder and on every family's tiny model,
    and decoded no faster there (BENCHMARKS.md, "Quality: settings against float32").
    `--dtype bfloat16` still asks for it."""
    if name != "auto":
        return DTYPES[name]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _bf16_above_rows(config: ModelConfig, native_with_casts: bool) -> int | None:
    """The row count above which the native kernel's calls go to bf16 copies of the weights,
    or None for no copies. Copies only when asked for (`batched_matmul bfloat16`): auto keeps
    none, as bf16 activations left float32's top-1 prediction at 32 sequences more often than
    issue 50's bound allows (BENCHMARKS.md, "Quality: settings against float32"). The row count
    is where bf16 overtook the int8 path with the copies this process makes (AMX tiles or
    oneDNN's slices, model/linear.py)."""
    if config.batched_matmul != "bfloat16":
        return None
    if not native_with_casts:
        raise ValueError("batched_matmul 'bfloat16' applies to the native kernel's matmuls "
                         "(a GGUF model with block-quantized weights in float32, and a "
                         "C++ compiler); use 'native' or 'auto'")
    return BF16_ABOVE_ROWS_AMX if amx_kernel_runs() else BF16_ABOVE_ROWS


def _native_decode(backend: str, arch: ModelArch, block_size: int, device: torch.device,
                   dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    if backend == "torch" or (backend == "auto" and device.type != "cpu"):
        return False
    ops = paged_attention_ops() if device.type == "cpu" else None
    if ops is not None and ops.supported(arch.num_heads, arch.num_kv_heads, arch.head_dim,
                                         block_size, dtype, kv_dtype):
        return True
    if backend == "native":
        raise ValueError(
            "attention_backend 'native' is unavailable: it needs a CPU device, a C++ "
            "compiler (see any warning above), block_size 16, head_dim 64 or 128 with 1-8 "
            "query heads per kv head (or 256 with 1, 2, 4 or 8) and float32 (KV cache "
            "float32 or float16) or bfloat16 (KV cache bfloat16); use 'torch' or 'auto'")
    return False


def _linear_backend(backend: str, has_block_quant: bool, device: torch.device,
                    dtype: torch.dtype) -> str:
    """The first of native, onednn, torch that applies (auto), or the one named."""
    if backend == "torch":
        return "torch"
    onednn = onednn_prepack_supported(device, dtype)
    if backend in ("auto", "native") and onednn:
        ops = block_quant_linear_ops()
        if has_block_quant and ops is not None and ops.supported():
            return "native"
        if backend == "native":
            raise ValueError(
                "linear_backend 'native' needs a GGUF model with block-quantized weights "
                "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 or K-quants), "
                "a C++ compiler (see any warning above) and a CPU with AVX2 and FMA; use "
                "'onednn' or 'auto'")
    if onednn:
        return "onednn"
    if backend in ("onednn", "native"):
        raise ValueError(f"linear_backend {backend!r} needs a CPU device, float32 and a "
                         "torch built with oneDNN (mkldnn); use 'torch' or 'auto'")
    return "torch"
