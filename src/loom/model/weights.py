"""Weights as the loader hands them to the model: named tensors made on first use, and a GGUF's
block-quantized matrices kept in the file's own format."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from loom.model.arch import ModelArch
from loom.model.tokenizer import Tokenizer

# Bytes of one block of 32 weights: (header, codes). The header is the fp16 scale, then, for
# the kinds with one, the fp16 offset. Q4_0, Q4_1 and Q8_0 are the GGUF's own; I8 (int8 codes
# with an offset) holds any of them, for a stack of parts of different kinds that must be one
# kind (BlockQuantWeight.cat: a reordered qkv, a mixture's gate_up).
# Q4_K's blocks of 32 keep its own numbers (requant.py): the header is its super-block's fp16
# d and dmin, then the block's 6-bit scale and min as a byte each; scale d * scale and offset
# -dmin * min, both exact in fp32 (not fp16 values: a stack with other kinds rounds them).
# Q6_K's too, with a scale per 16 weights: the header is its super-block's fp16 d and the two
# int8 scales; the codes 0..63 (w = d * scale * (code - 32)) are 16 bytes of low nibbles as
# Q4_1's, then 8 of high 2 bits, byte j holding inputs j, j + 8, j + 16 and j + 24 from bit 0.
BLOCK_LAYOUT = {"Q4_0": (2, 16), "Q4_1": (4, 16), "Q8_0": (2, 32), "I8": (4, 32),
                "Q4_K": (6, 16), "Q6_K": (4, 24)}
K_QUANT_KINDS = ("Q4_K", "Q6_K")  # a GGUF's own, not made from codes (requant.native_blocks)
FOUR_BIT_KINDS = ("Q4_0", "Q4_1", "Q4_K")


@dataclass(frozen=True)
class BlockQuantWeight:
    """A weight matrix as a GGUF file stores it: per block of 32 along each row, an fp16 scale
    (and offset) and int codes, w = codes * scale + offset. The blocks are the file's bytes,
    not copied (for most matrices a view of the file map): the native matmul
    (csrc/block_quant_linear.cpp) re-lays them out once and computes with the file's own
    numbers, and nothing on the way unpacks the codes (which was most of the start-up).
    4-bit codes: byte j of a block holds input j in its low nibble and input j + 16 in its
    high one; Q4_0's count from 8. (Q4_K's scales and offsets are products, Q6_K's per 16
    weights: BLOCK_LAYOUT.)"""

    blocks: torch.Tensor  # uint8 [out, in // 32, header + code bytes]
    kind: str  # a key of BLOCK_LAYOUT

    @property
    def shape(self) -> tuple[int, int]:
        return self.blocks.shape[0], self.blocks.shape[1] * 32

    @property
    def codes(self) -> torch.Tensor:
        """int8 [out, in]: the codes as w = codes * scale + offset counts them."""
        return _codes(self.blocks, self.kind).reshape(self.shape)

    @property
    def scale(self) -> torch.Tensor:
        """float32 [out, in // 32]."""
        return _scale(self.blocks, self.kind)[..., 0]

    @property
    def offset(self) -> torch.Tensor:
        """float32 [out, in // 32] (zeros for the kinds without one)."""
        offset = _offset(self.blocks, self.kind)
        return torch.zeros(self.blocks.shape[:2]) if offset is None else offset[..., 0]

    @staticmethod
    def from_codes(codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
                   kind: str | None = None) -> BlockQuantWeight:
        """The blocks of w = codes * scale + offset (int8 codes [out, in], float32 scales and
        offsets [out, in // 32] that fp16 holds exactly, as a GGUF's are) in `kind`, by default
        the smallest kind that holds them."""
        if not all(torch.equal(t.half().float(), t) for t in (scale, offset)):
            raise ValueError("block scales and offsets must be fp16 values")
        if kind in K_QUANT_KINDS:
            raise ValueError(f"{kind} blocks are a GGUF's own (requant.native_blocks), not made "
                             "from codes")
        kind = kind or _smallest_kind(codes, offset)
        stored = codes + 8 if kind == "Q4_0" else codes
        rows, cols = codes.shape
        stored = stored.to(torch.int8).view(torch.uint8).view(rows, cols // 32, 32)
        if kind in FOUR_BIT_KINDS:
            stored = stored[..., :16] | (stored[..., 16:] << 4)
        header = [scale] if BLOCK_LAYOUT[kind][0] == 2 else [scale, offset]
        parts = [t.half().unsqueeze(-1).view(torch.uint8) for t in header] + [stored]
        return BlockQuantWeight(torch.cat(parts, dim=-1), kind)

    @staticmethod
    def runs(parts: list[BlockQuantWeight]) -> list[BlockQuantWeight]:
        """Parts stacked along the output rows (a fused qkv or gate_up) as runs of one kind
        each, in order: adjacent parts of a kind joined, each run kept in its own kind for a
        Linear of several (a Q4_K_M's qkv with a Q6_K v: [q k] Q4_K, [v] Q6_K, at 4.625 and
        6.625 bits a weight, where `cat` takes all three to I8's 9)."""
        runs: list[list[BlockQuantWeight]] = []
        for part in parts:
            if runs and runs[-1][0].kind == part.kind:
                runs[-1].append(part)
            else:
                runs.append([part])
        return [BlockQuantWeight.cat(run) for run in runs]

    @staticmethod
    def cat(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """Stacked along the output rows, as one weight (where its rows are reordered, or for a
        mixture's gate_up: `runs` keeps a dense stack's kinds). Parts
        of different kinds go to one kind that holds them all, with fp16 scales and offsets:
        Q4_K's round to fp16 there (at most 2^-11 of each), as they did before Q4_K had blocks
        of its own, and Q6_K's weights, a scale per 16, are quantized again to Q8_0 first."""
        if len({p.kind for p in parts}) == 1:
            return BlockQuantWeight(torch.cat([p.blocks for p in parts]), parts[0].kind)
        parts = [p.as_q8_0() if p.kind == "Q6_K" else p for p in parts]
        codes, scale, offset = (torch.cat([getattr(p, f) for p in parts])
                                for f in ("codes", "scale", "offset"))
        return BlockQuantWeight.from_codes(codes, scale.half().float(), offset.half().float())

    def as_q8_0(self) -> BlockQuantWeight:
        """The weights quantized again per 32, to Q8_0 (as every Q6_K tensor was before Q6_K
        had blocks of its own): for a stack with other kinds, which holds one scale a block."""
        from loom.model.kernels import gguf_blocks_ops

        ops = gguf_blocks_ops()
        if ops is None:
            raise RuntimeError("quantizing again needs loom's compiled gguf_blocks.cpp")
        return BlockQuantWeight(torch.from_numpy(ops.requantized_q8_0(
            self.dequantize().numpy())), "Q8_0")

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The fp32 rows `ids` of the weight, as dequantize() has them: an embedding lookup
        that never makes the whole fp32 table (a small model's largest weight)."""
        return _dequantize(self.blocks[ids], self.kind)

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight: bit for bit what gguf's dequantize gives for these blocks, at a
        fraction of its time and memory."""
        return _dequantize(self.blocks, self.kind)


def _smallest_kind(codes: torch.Tensor, offset: torch.Tensor) -> str:
    lo, hi, no_offset = int(codes.min()), int(codes.max()), not bool(offset.any())
    if no_offset and -8 <= lo and hi <= 7:
        return "Q4_0"
    if 0 <= lo and hi <= 15:
        return "Q4_1"
    return "Q8_0" if no_offset else "I8"


def _dequantize(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """[rows, in // 32, block bytes] -> fp32 [rows, in]: codes * scale (+ offset), in gguf's
    order of operations."""
    rows, num_blocks, _ = blocks.shape
    if kind == "Q6_K":  # a scale per 16
        scale = (_half(blocks, 0) * blocks[..., 2:4].view(torch.int8).float()).repeat_interleave(
            16, dim=-1)
        return (scale * _codes(blocks, kind).float()).view(rows, num_blocks * 32)
    w = _codes(blocks, kind).float().mul_(_scale(blocks, kind))
    offset = _offset(blocks, kind)
    if offset is not None:
        w.add_(offset)
    return w.view(rows, num_blocks * 32)


def _scale(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """float32 [..., 1]: each block's scale (Q4_K's d * scale, exact in fp32)."""
    if kind == "Q6_K":
        raise ValueError("Q6_K blocks have two scales, one per 16 weights")
    if kind == "Q4_K":
        return _half(blocks, 0) * blocks[..., 4:5].float()
    return _half(blocks, 0)


def _offset(blocks: torch.Tensor, kind: str) -> torch.Tensor | None:
    """float32 [..., 1]: each block's offset (Q4_K's -dmin * min), None for the kinds
    without one."""
    if kind == "Q4_K":
        return -(_half(blocks, 2) * blocks[..., 5:6].float())
    return _half(blocks, 2) if BLOCK_LAYOUT[kind][0] == 4 and kind != "Q6_K" else None


def _codes(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """int8 [..., 32] codes of each block."""
    raw = blocks[..., BLOCK_LAYOUT[kind][0]:]
    if kind == "Q6_K":  # (code - 32), the low nibbles and the high 2 bits joined
        low = torch.cat([raw[..., :16] & 0x0F, raw[..., :16] >> 4], dim=-1)
        high = torch.cat([(raw[..., 16:24] >> (2 * s)) & 3 for s in range(4)], dim=-1)
        return (low | (high << 4)).view(torch.int8) - 32
    if kind not in FOUR_BIT_KINDS:
        return raw.view(torch.int8)
    codes = torch.cat([raw & 0x0F, raw >> 4], dim=-1).view(torch.int8)
    return codes - 8 if kind == "Q4_0" else codes


def _half(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """float32 [..., 1] from the fp16 at byte `start` of each block."""
    return blocks[..., start:start + 2].view(torch.float16).float()


Made = TypeVar("Made")


class LazyWeights(Mapping[str, Made], Generic[Made]):
    """Named tensors (or block-quantized weights), each made on first access and then kept (so
    two users of one name, like a tied embedding and lm_head, share it). Names and `in` cost
    nothing."""

    def __init__(self, makers: Mapping[str, Callable[[], Made]]) -> None:
        self._makers = dict(makers)
        self._made: dict[str, Made] = {}

    def __getitem__(self, name: str) -> Made:
        if name not in self._made:
            self._made[name] = self._makers[name]()
        return self._made[name]

    def __contains__(self, name: object) -> bool:
        return name in self._makers  # Mapping's default would make the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


@dataclass
class LoadedModel:
    arch: ModelArch
    weights: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str
    # The GGUF's block-quantized weights as the native matmul reads them (Q4_0/Q4_1/Q8_0 in
    # the file's own format, other types converted: requant.py), by the same names as
    # `weights`. Made on first use: a backend other than the native one never pays for the
    # conversion.
    block_quant: Mapping[str, BlockQuantWeight] = field(default_factory=dict)
    # how many of them each conversion makes (requant.conversion: "Q6_K quantized again ...")
    conversions: Mapping[str, int] = field(default_factory=dict)
