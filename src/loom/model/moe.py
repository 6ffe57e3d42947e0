"""Mixture-of-experts MLP layers (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE), in place of a decoder
layer's dense MLP: a router scores every expert per token, the token's top-k experts run their
SiLU-gated MLPs, and their outputs are summed by the router's weights; Qwen2-MoE adds a shared
expert that every token takes, scaled by sigmoid(x . g).

    logits = x @ router^T                              [tokens, E]
    ids    = top_k(logits)                             ties: the lower expert id
    w      = softmax(logits)[ids]                      (/ their sum where `normalize`)
    y      = sum_j w_j * down_e(silu(gate_e x) * up_e x), e = ids_j   (+ shared expert)

The families' routing differs only in `normalize`: Mixtral divides by the chosen weights' sum
(its transformers code takes softmax over all E, top-k, then divides, which is the softmax over
the top-k logits), Qwen3-MoE, OLMoE and Qwen2-MoE iff their config's norm_topk_prob. transformers
picks with torch.topk, whose choice among equal scores is unspecified (on a CPU it took neither
the lower nor the higher ids consistently); here ties go to the lower expert id, in both paths
below.

Two ways to compute the same sums:
- **native** (csrc/block_quant_linear.cpp `moe_experts`, a GGUF's block-quantized experts on an
  AVX2 CPU): one call per layer and step does the routing, every chosen expert's gate_up ->
  SiLU * up -> down on its panels (the dense kernel's layout and tiles) and the weighted sum.
  Tokens are grouped by expert, so a decode step reads only its tokens' chosen experts, and a
  prefill step each chosen expert once for all its tokens; an expert with few tokens runs on
  the int8 path, one with many on the fp32 one, by the dense layers' rule (INT8_MAX_ROWS).
- **torch** (`reference`): torch ops, a loop over the chosen experts: for
  machines without the compiled kernel, for fp32 weights (a Hugging Face folder, an F16
  GGUF), and the tests' oracle.

Build a block with `moe_from_hf` (transformers' names: the per-expert tensors save_pretrained
writes, the stacked ones of a transformers-5 state dict, or a GGUF's as the loader names them,
with their blocks: what the decoder calls for each layer with experts) or `moe_from_gguf`
(llama.cpp's stacked expert tensors of one layer, read as the loader reads them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from loom.model import batch_invariant
from loom.model.arch import ModelArch, ModelLoadError
from loom.model.gguf_file import GGUFTensor
from loom.model.linear import INT8_MAX_ROWS, PANEL_CHANNELS, to_panels
from loom.model.loader import GGUF_STACKED_EXPERTS, gguf_weights
from loom.model.weights import FOUR_BIT_KINDS, BlockQuantWeight


@dataclass(frozen=True)
class Routing:
    """How a layer picks and weighs its experts."""

    num_experts: int
    top_k: int  # experts per token
    normalize: bool  # divide the chosen experts' weights by their sum

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k (num_experts_per_tok) must be between 1 and num_experts "
                             f"({self.num_experts}), got {self.top_k}")

    @staticmethod
    def from_arch(arch: ModelArch) -> Routing:
        return Routing(arch.num_experts, arch.num_experts_per_tok, arch.norm_topk_prob)


@dataclass(frozen=True)
class ExpertBlocks:
    """E block-quantized matrices [N, K] of one kind, stacked: what a GGUF's 3-D expert tensor
    holds. blocks: uint8 [E, N, K / 32, block bytes] (weights.py's block layout)."""

    blocks: torch.Tensor
    kind: str

    @property
    def shape(self) -> tuple[int, int, int]:
        experts, rows, num_blocks, _ = self.blocks.shape
        return experts, rows, num_blocks * 32

    def expert(self, e: int) -> BlockQuantWeight:
        return BlockQuantWeight(self.blocks[e], self.kind)

    def flat(self) -> BlockQuantWeight:
        """The experts' rows one after another: [E * N, K]."""
        experts, rows, num_blocks, size = self.blocks.shape
        return BlockQuantWeight(self.blocks.reshape(experts * rows, num_blocks, size), self.kind)


Matrices = torch.Tensor | ExpertBlocks  # [E, N, K]: fp32 (or the model's dtype) or blocks


def _shape(m: Matrices) -> tuple[int, int, int]:
    return m.shape if isinstance(m, ExpertBlocks) else tuple(m.shape)


@dataclass(frozen=True)
class Experts:
    """E SiLU-gated MLPs, stacked: gate and up [E, I, H], down [E, H, I]."""

    gate: Matrices
    up: Matrices
    down: Matrices

    def __post_init__(self) -> None:
        (e, i, h), up, down = _shape(self.gate), _shape(self.up), _shape(self.down)
        if up != (e, i, h) or down != (e, h, i):
            raise ModelLoadError(f"expert weights disagree: gate {(e, i, h)}, up {up}, down "
                                 f"{down} (want up as gate, down [experts, hidden, inter])")

    @property
    def num_experts(self) -> int:
        return _shape(self.gate)[0]

    @property
    def hidden_size(self) -> int:
        return _shape(self.gate)[2]

    def weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """Expert e's (gate, up, down) in `dtype` (block-quantized ones dequantized)."""
        return tuple((m.expert(e).dequantize() if isinstance(m, ExpertBlocks) else m[e])
                     .to(dtype) for m in (self.gate, self.up, self.down))


@dataclass(frozen=True)
class SharedExpert:
    """Qwen2-MoE's expert that every token takes: one MLP (Experts of one) and, where the family
    has it, the gate vector g [H] of its weight sigmoid(x . g) (else weight 1)."""

    mlp: Experts
    gate: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.mlp.num_experts != 1:
            raise ModelLoadError(f"a shared expert is one MLP, got {self.mlp.num_experts}")
        if self.gate is not None and self.gate.shape != (self.mlp.hidden_size,):
            raise ModelLoadError(f"the shared expert's gate must be [{self.mlp.hidden_size}], "
                                 f"got {list(self.gate.shape)}")


def route(logits: torch.Tensor, routing: Routing) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int64 [tokens, k], weights float32 [tokens, k]): each token's top-k experts by
    logit, highest first, equal logits in expert order (a stable sort); softmax weights over
    all the logits, renormalised over the chosen ones where routing.normalize."""
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :routing.top_k]
    weights = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(-1, ids)
    if routing.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return ids, weights


def _mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor
         ) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def reference(x: torch.Tensor, logits: torch.Tensor, routing: Routing, experts: Experts,
              shared: SharedExpert | None = None) -> torch.Tensor:
    """The block's output [tokens, H] with torch ops: per chosen expert (in id order) its
    tokens' MLP, scaled by their weights and added up; then the shared expert."""
    ids, weights = route(logits, routing)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = (ids == e).nonzero(as_tuple=True)
        y = _mlp(x[token], *experts.weights(e, x.dtype))
        out.index_add_(0, token, y * weights[token, slot, None].to(x.dtype))
    if shared is not None:
        y = _mlp(x, *shared.mlp.weights(0, x.dtype))
        if shared.gate is not None:
            y = y * torch.sigmoid(x @ shared.gate.to(x.dtype))[:, None]
        out = out + y
    return out


@dataclass(frozen=True)
class _Panels:
    """Experts in the native kernel's layout: gate_up uint8 [E, I / 4, H / 32, record] (each
    expert's gate panel p, then its up panel p), down uint8 [E, H / 8, I / 32, record]."""

    gate_up: torch.Tensor
    down: torch.Tensor


def _native_fits(experts: Experts) -> bool:
    """Block-quantized throughout, in whole panel pairs and quantization blocks."""
    if not all(isinstance(m, ExpertBlocks) for m in (experts.gate, experts.up, experts.down)):
        return False
    _, inter, hidden = _shape(experts.gate)
    return inter % 32 == 0 and hidden % 32 == 0


def _code_bits(kind: str) -> int:
    return 4 if kind in FOUR_BIT_KINDS else 8


def _panels(experts: Experts, ops: ModuleType) -> _Panels:
    gate, up, down = experts.gate, experts.up, experts.down
    e, inter, hidden = gate.shape
    if _code_bits(gate.kind) != _code_bits(up.kind):  # one record size: one kind holds both
        both = BlockQuantWeight.cat([gate.flat(), up.flat()])
        gate, up = (ExpertBlocks(half.view(e, inter, *half.shape[1:]), both.kind)
                    for half in both.blocks.chunk(2))
    pairs = [to_panels(m.flat(), ops).view(e, inter // PANEL_CHANNELS, hidden // 32, -1)
             for m in (gate, up)]
    gate_up = torch.stack(pairs, dim=2).view(e, inter // 4, hidden // 32, -1)
    return _Panels(gate_up, to_panels(down.flat(), ops).view(e, hidden // PANEL_CHANNELS,
                                                             inter // 32, -1))


class MoeBlock:
    """One layer's mixture of experts: forward(x [tokens, H]) -> [tokens, H]."""

    def __init__(self, routing: Routing, router: torch.Tensor, experts: Experts,
                 shared: SharedExpert | None = None, block_quant_ops: ModuleType | None = None,
                 int8_max_rows: Mapping[int, int] = INT8_MAX_ROWS) -> None:
        """router: [E, H] (float32 for the native path). block_quant_ops: the compiled
        block-quantized matmul; with it, block-quantized experts run on its MoE kernel, and
        their blocks are not kept beyond the kernel's panels. int8_max_rows: an expert of at
        most this many rows (by code width) takes the kernel's int8 path; --batch-invariant's
        bounds (every call) also take each token's router logits by a call of its own and
        refuse experts off the kernel (model/batch_invariant.py)."""
        if router.shape != (routing.num_experts, experts.hidden_size):
            raise ModelLoadError(f"the router must be [{routing.num_experts}, "
                                 f"{experts.hidden_size}], got {list(router.shape)}")
        if experts.num_experts != routing.num_experts:
            raise ModelLoadError(f"{experts.num_experts} experts' weights for a router of "
                                 f"{routing.num_experts}")
        if shared is not None and shared.mlp.hidden_size != experts.hidden_size:
            raise ModelLoadError("the shared expert's hidden size differs from the experts'")
        self.routing, self.router = routing, router
        self.int8_max_rows = dict(int8_max_rows)
        native = (block_quant_ops is not None and block_quant_ops.supported()
                  and _native_fits(experts) and (shared is None or _native_fits(shared.mlp)))
        self._per_token_router = batch_invariant.pinned(int8_max_rows)
        if self._per_token_router:
            batch_invariant.check_experts_native(native)
        self._ops = block_quant_ops if native else None
        self._panels = _panels(experts, block_quant_ops) if native else None
        self._shared_panels = (_panels(shared.mlp, block_quant_ops)
                               if native and shared is not None else None)
        self._shared_gate = (None if shared is None or shared.gate is None
                             else shared.gate.float().contiguous())
        # the torch path's weights (the native one holds its panels instead)
        self.experts = None if native else experts
        self.shared = None if native else shared

    @property
    def native(self) -> bool:
        return self._ops is not None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # a matmul's reduction order may follow its row count: pinned, one row a call
        logits = (torch.cat([F.linear(row, self.router) for row in x.split(1)])
                  if self._per_token_router and len(x) > 1 else F.linear(x, self.router))
        if self._ops is None:
            return reference(x, logits, self.routing, self.experts, self.shared)
        shared = self._shared_panels
        return self._ops.moe_experts(
            x, logits, self.routing.top_k, self.routing.normalize, self._panels.gate_up,
            self._panels.down, None if shared is None else shared.gate_up[0],
            None if shared is None else shared.down[0], self._shared_gate,
            self.int8_max_rows[4], self.int8_max_rows[8])


# -- from a checkpoint ---------------------------------------------------------------------------

_GGUF_NAMES = {hf: gguf for gguf, hf in GGUF_STACKED_EXPERTS.items()}  # for the errors


def moe_from_hf(weights: Mapping[str, torch.Tensor], prefix: str, routing: Routing,
                block_quant: Mapping[str, BlockQuantWeight] | None = None,
                block_quant_ops: ModuleType | None = None,
                int8_max_rows: Mapping[int, int] = INT8_MAX_ROWS) -> MoeBlock:
    """The MoE block of the decoder layer whose names start with `prefix` ("model.layers.3."),
    by transformers' names: Mixtral's `block_sparse_moe.gate` and `.experts.{e}.w1/w3/w2`
    (gate, up, down), the others' `mlp.gate` and `mlp.experts.{e}.gate_proj/up_proj/down_proj`
    (what save_pretrained writes, transformers 5 too), or stacked [E, N, K]: a transformers-5
    state dict's `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and
    `mlp.experts.down_proj`, or a GGUF's as the loader names them (`mlp.experts.gate_proj` and
    `up_proj` where the file stores them apart); Qwen2-MoE's `mlp.shared_expert.*_proj` and
    `mlp.shared_expert_gate` [1, H]. A stacked or shared matrix found in `block_quant` (a
    GGUF's blocks, E * N rows) is taken as its blocks, which with block_quant_ops run on the
    native kernel; fp32 weights run on the torch path. int8_max_rows: MoeBlock's."""
    mixtral = prefix + "block_sparse_moe.gate.weight" in weights
    base = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    block_quant = block_quant or {}

    def get(name: str) -> torch.Tensor:
        if name not in weights:
            gguf = _GGUF_NAMES.get(name.removeprefix(prefix))
            where = f" (a GGUF's blk.{prefix.split('.')[-2]}.{gguf})" if gguf else ""
            raise ModelLoadError(f"the MoE layer at {prefix!r} lacks {name!r}{where}")
        return weights[name]

    def matrices(name: str, experts: int) -> Matrices:
        """A stacked tensor [experts, N, K]: its blocks where there are, else its weights."""
        if name not in block_quant:
            weight = get(name)
            return weight if weight.dim() == 3 else weight[None]
        blocks = block_quant[name].blocks
        return ExpertBlocks(blocks.view(experts, -1, *blocks.shape[1:]), block_quant[name].kind)

    e, stacked = routing.num_experts, base + "experts."
    if stacked + "gate_up_proj" in weights or stacked + "gate_proj" in weights:
        gate, up = (_halves(matrices(stacked + "gate_up_proj", e))
                    if stacked + "gate_up_proj" in weights else
                    (matrices(stacked + n, e) for n in ("gate_proj", "up_proj")))
        down = matrices(stacked + "down_proj", e)
    else:
        gate, up, down = (torch.stack([get(f"{stacked}{x}.{n}.weight") for x in range(e)])
                          for n in names)
    shared = None
    if base + "shared_expert.gate_proj.weight" in weights:
        mlp = Experts(*(matrices(f"{base}shared_expert.{n}.weight", 1)
                        for n in ("gate_proj", "up_proj", "down_proj")))
        gate_weight = weights.get(base + "shared_expert_gate.weight")
        shared = SharedExpert(mlp, None if gate_weight is None else gate_weight.reshape(-1))
    return MoeBlock(routing, get(base + "gate.weight"), Experts(gate, up, down), shared,
                    block_quant_ops, int8_max_rows)


def _halves(both: Matrices) -> tuple[Matrices, Matrices]:
    """[E, 2I, K] stacked gate and up rows -> gate [E, I, K], up [E, I, K]."""
    inter = _shape(both)[1] // 2
    if isinstance(both, ExpertBlocks):
        return tuple(ExpertBlocks(both.blocks[:, part].contiguous(), both.kind)
                     for part in (slice(0, inter), slice(inter, None)))
    return both[:, :inter], both[:, inter:]


def moe_from_gguf(tensors: Mapping[str, GGUFTensor], layer: int, routing: Routing,
                  block_quant_ops: ModuleType | None) -> MoeBlock:
    """The MoE block of GGUF layer `layer`, from llama.cpp's stacked tensors (blk.N.ffn_gate_inp,
    the router; ffn_gate_exps and ffn_up_exps [E, I, H], or one ffn_gate_up_exps [E, 2I, H],
    gate rows first; ffn_down_exps [E, H, I]; Qwen2-MoE's ffn_{gate,up,down}_shexp and
    ffn_gate_inp_shexp), read as the model loader reads them (loader.gguf_weights): Q4_0, Q4_1
    and Q8_0 experts are the file's blocks, the types requant.py converts are converted, others
    dequantized to fp32 (the torch path)."""
    p = f"blk.{layer}."
    weights = gguf_weights(t for name, t in tensors.items() if name.startswith(p))
    return moe_from_hf(weights.weights, f"model.layers.{layer}.", routing, weights.block_quant,
                       block_quant_ops)
