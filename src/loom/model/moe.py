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
picks with torch.topk, whose order among equal scores is unspecified (on a CPU it returned the
higher ids first); here ties go to the lower expert id, in both paths below.

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
writes, or the stacked ones of a transformers-5 state dict) or `moe_from_gguf` (llama.cpp's
stacked expert tensors, experts first).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F

from loom.model.arch import ModelArch, ModelLoadError
from loom.model.gguf_file import GGUFTensor, dequantize
from loom.model.linear import INT8_MAX_ROWS, PANEL_CHANNELS, to_panels
from loom.model.requant import CONVERTED_KINDS, FILE_KINDS, converts_here, native_blocks
from loom.model.weights import BLOCK_LAYOUT, FOUR_BIT_KINDS, BlockQuantWeight


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
        most this many rows (by code width) takes the kernel's int8 path."""
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
        logits = F.linear(x, self.router)
        if self._ops is None:
            return reference(x, logits, self.routing, self.experts, self.shared)
        shared = self._shared_panels
        return self._ops.moe_experts(
            x, logits, self.routing.top_k, self.routing.normalize, self._panels.gate_up,
            self._panels.down, None if shared is None else shared.gate_up[0],
            None if shared is None else shared.down[0], self._shared_gate,
            self.int8_max_rows[4], self.int8_max_rows[8])


# -- from a checkpoint ---------------------------------------------------------------------------

def moe_from_hf(weights: Mapping[str, torch.Tensor], prefix: str, routing: Routing
                ) -> MoeBlock:
    """The MoE block of the decoder layer whose names start with `prefix` ("model.layers.3."),
    by transformers' names: Mixtral's `block_sparse_moe.gate` and `.experts.{e}.w1/w3/w2`
    (gate, up, down), the others' `mlp.gate` and `mlp.experts.{e}.gate_proj/up_proj/down_proj`
    (what save_pretrained writes, transformers 5 too), or a transformers-5 state dict's stacked
    `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and `mlp.experts.down_proj`;
    Qwen2-MoE's `mlp.shared_expert.*_proj` and `mlp.shared_expert_gate` [1, H]. fp32 weights
    run on the torch path."""
    mixtral = prefix + "block_sparse_moe.gate.weight" in weights
    base = prefix + ("block_sparse_moe." if mixtral else "mlp.")
    names = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")

    def get(name: str) -> torch.Tensor:
        if name not in weights:
            raise ModelLoadError(f"the MoE layer at {prefix!r} lacks {name!r}")
        return weights[name]

    if base + "experts.gate_up_proj" in weights:
        gate, up = get(base + "experts.gate_up_proj").chunk(2, dim=1)
        experts = Experts(gate, up, get(base + "experts.down_proj"))
    else:
        experts = Experts(*(torch.stack([get(f"{base}experts.{e}.{n}.weight")
                                         for e in range(routing.num_experts)])
                            for n in names))
    shared = None
    if base + "shared_expert.gate_proj.weight" in weights:
        mlp = Experts(*(get(f"{base}shared_expert.{n}.weight")[None]
                        for n in ("gate_proj", "up_proj", "down_proj")))
        gate = weights.get(base + "shared_expert_gate.weight")
        shared = SharedExpert(mlp, None if gate is None else gate.reshape(-1))
    return MoeBlock(routing, get(base + "gate.weight"), experts, shared)


def moe_from_gguf(tensors: Mapping[str, GGUFTensor], layer: int, routing: Routing,
                  block_quant_ops: ModuleType | None) -> MoeBlock:
    """The MoE block of GGUF layer `layer`, from llama.cpp's stacked tensors: blk.N.ffn_gate_inp
    (the router), ffn_gate_exps and ffn_up_exps [E, I, H] (or one ffn_gate_up_exps [E, 2I, H],
    gate rows first), ffn_down_exps [E, H, I], and Qwen2-MoE's ffn_{gate,up,down}_shexp with
    ffn_gate_inp_shexp. Q4_0, Q4_1 and Q8_0 experts are the file's blocks, the types
    requant.py converts are converted (each expert's rows as a 2-D tensor's), others
    dequantized to fp32 (the torch path)."""
    p = f"blk.{layer}."

    def get(name: str) -> GGUFTensor:
        if p + name not in tensors:
            raise ModelLoadError(f"GGUF layer {layer} of a mixture of experts lacks {p + name!r}")
        return tensors[p + name]

    if p + "ffn_gate_up_exps.weight" in tensors:
        both = _gguf_matrices(get("ffn_gate_up_exps.weight"))
        inter = _shape(both)[1] // 2
        gate, up = ((ExpertBlocks(both.blocks[:, part].contiguous(), both.kind)
                     if isinstance(both, ExpertBlocks) else both[:, part])
                    for part in (slice(0, inter), slice(inter, None)))
    else:
        gate, up = (_gguf_matrices(get(f"ffn_{n}_exps.weight")) for n in ("gate", "up"))
    experts = Experts(gate, up, _gguf_matrices(get("ffn_down_exps.weight")))
    shared = None
    if p + "ffn_gate_shexp.weight" in tensors:
        mlp = Experts(*(_gguf_matrices(get(f"ffn_{n}_shexp.weight"))
                        for n in ("gate", "up", "down")))
        gate_inp = tensors.get(p + "ffn_gate_inp_shexp.weight")
        shared = SharedExpert(mlp, None if gate_inp is None else _copied(gate_inp).reshape(-1))
    return MoeBlock(routing, _copied(get("ffn_gate_inp.weight")), experts, shared,
                    block_quant_ops)


def _copied(tensor: GGUFTensor) -> torch.Tensor:
    """A small tensor in fp32, copied out of the file map: a view would keep the whole file
    mapped, and every page loading touched resident, for as long as the model runs."""
    return torch.from_numpy(np.array(dequantize(tensor), np.float32))


def _gguf_matrices(tensor: GGUFTensor) -> Matrices:
    """A GGUF expert tensor [E, N, K] (a 2-D one as E = 1) as blocks the native kernel reads
    or, for the types it does not, fp32."""
    shape = tensor.shape if len(tensor.shape) == 3 else (1, *tensor.shape)
    experts, rows, cols = shape
    if tensor.kind in FILE_KINDS:
        size = sum(BLOCK_LAYOUT[tensor.kind])
        return ExpertBlocks(torch.from_numpy(tensor.data.reshape(experts, rows, cols // 32, size)),
                            tensor.kind)
    if tensor.kind in CONVERTED_KINDS and converts_here():
        bq = native_blocks(tensor.kind, tensor.data, shape)
        return ExpertBlocks(bq.blocks.view(experts, rows, *bq.blocks.shape[1:]), bq.kind)
    return torch.from_numpy(np.ascontiguousarray(dequantize(tensor))).reshape(shape)
