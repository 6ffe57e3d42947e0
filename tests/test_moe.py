"""loom's mixture-of-experts block (loom/model/moe.py): against transformers' own MoE blocks on
tiny random configs, in float32; its native kernel (csrc/block_quant_linear.cpp `moe_experts`)
against its torch path on random block-quantized experts, for decode-sized and prefill-sized
steps, on both of the kernel's paths; ties in the routing; and a GGUF's stacked expert tensors
read back as the per-expert weights they were written from."""

from __future__ import annotations

import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from safetensors.torch import load_file

from loom.model.batch_invariant import INT8_EVERY_ROW
from loom.model.gguf_file import read_gguf
from loom.model.kernels import block_quant_linear_ops
from loom.model.moe import (
    ExpertBlocks,
    Experts,
    MoeBlock,
    Routing,
    SharedExpert,
    moe_from_gguf,
    moe_from_hf,
    reference,
    route,
)
from loom.model.requant import SAME_CODES, converts_here, native_blocks
from loom.model.weights import BlockQuantWeight

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout: benchmarks.*
from benchmarks import synthetic_gguf  # noqa: E402 - the writer of model-shaped files

pytestmark = pytest.mark.unit

ops = block_quant_linear_ops()
needs_kernel = pytest.mark.skipif(ops is None or not ops.supported(),
                                  reason="no C++ compiler or no AVX2/FMA/F16C")
PATHS = {"int8": {4: 1 << 30, 8: 1 << 30}, "fp32": {4: 0, 8: 0}, "auto": None}
CODES = {"Q4_1": (0, 16), "Q4_0": (-8, 8), "Q8_0": (-128, 128)}
FP16_FIELDS = {"Q4_K": (0, 2), "Q6_K": (208,)}  # byte offsets of each type's fp16 fields


# -- against transformers ---------------------------------------------------------------------

def tiny_moe_model(family: str) -> tuple[torch.nn.Module, Routing]:
    """A one-layer model of the family with 8 experts, 2 a token, and its routing as the
    family's config says it (Mixtral always renormalises; the others as norm_topk_prob)."""
    import transformers as tf

    sizes = dict(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, num_experts_per_tok=2)
    if family == "mixtral":
        config = tf.MixtralConfig(intermediate_size=32, num_local_experts=8, **sizes)
        model, normalize = tf.MixtralForCausalLM, True
    elif family == "qwen2_moe":
        config = tf.Qwen2MoeConfig(intermediate_size=96, moe_intermediate_size=32,
                                   shared_expert_intermediate_size=64, num_experts=8,
                                   norm_topk_prob=False, **sizes)
        model, normalize = tf.Qwen2MoeForCausalLM, False
    elif family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(intermediate_size=96, moe_intermediate_size=32, head_dim=32,
                                   num_experts=8, norm_topk_prob=True, **sizes)
        model, normalize = tf.Qwen3MoeForCausalLM, True
    else:
        config = tf.OlmoeConfig(intermediate_size=32, num_experts=8, norm_topk_prob=False,
                                pad_token_id=0, eos_token_id=1, **sizes)
        model, normalize = tf.OlmoeForCausalLM, False
    torch.manual_seed(0)
    built = model(config).eval()
    with torch.no_grad():  # weights of size 1, not 0.02: outputs far above fp32 rounding
        for name, param in built.named_parameters():
            if ".mlp." in name:
                param.normal_(0.0, 0.3)
    return built, Routing(8, 2, normalize)


@pytest.mark.parametrize("names", ["saved", "state_dict"])
@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"])
def test_block_matches_transformers(family: str, names: str, tmp_path: Path) -> None:
    """The block built from a checkpoint's names computes what transformers' own block does:
    from the per-expert tensors save_pretrained writes (Mixtral's block_sparse_moe.w1/w3/w2,
    the others' mlp.experts.{e}.*_proj, Qwen2-MoE's shared expert and its gate) and from the
    stacked ones of a transformers-5 state dict."""
    model, routing = tiny_moe_model(family)
    if names == "saved":
        model.save_pretrained(tmp_path)
        weights = load_file(str(tmp_path / "model.safetensors"))
        assert ("model.layers.0.block_sparse_moe.experts.7.w2.weight" if family == "mixtral"
                else "model.layers.0.mlp.experts.7.down_proj.weight") in weights
    else:
        weights = dict(model.state_dict())
        assert "model.layers.0.mlp.experts.gate_up_proj" in weights
    block = moe_from_hf(weights, "model.layers.0.", routing)
    assert (block.shared is not None) == (family == "qwen2_moe")
    x = torch.randn(1, 37, 64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = model.model.layers[0].mlp(x)[0]
        got = block(x[0])
    assert want.abs().amax() > 0.5
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_missing_expert_is_named() -> None:
    model, routing = tiny_moe_model("qwen3_moe")
    weights = {name: w for name, w in model.state_dict().items()}
    gate_up = weights.pop("model.layers.0.mlp.experts.gate_up_proj")
    for e in range(8):
        weights[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] = gate_up[e, :32]
    with pytest.raises(ValueError, match=r"experts\.0\.up_proj"):
        moe_from_hf(weights, "model.layers.0.", routing)


@pytest.mark.parametrize(("experts", "top_k"), [(0, 1), (8, 0), (8, 9)])
def test_routing_is_validated(experts: int, top_k: int) -> None:
    with pytest.raises(ValueError, match="num_experts|top_k"):
        Routing(experts, top_k, False)


# -- routing ties ------------------------------------------------------------------------------

def test_ties_go_to_the_lower_expert_id() -> None:
    """Equal logits are taken in expert order (torch.topk, which transformers uses, does not
    promise an order among them, and on a CPU took the higher ids)."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [0.0] * 5, [2.0, 2.0, 5.0, 2.0, 2.0]])
    ids, weights = route(logits, Routing(5, 2, normalize=False))
    assert ids.tolist() == [[1, 2], [0, 1], [2, 0]]
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(-1, ids))
    _, normalized = route(logits, Routing(5, 2, normalize=True))
    torch.testing.assert_close(normalized[1], torch.tensor([0.5, 0.5]))


@needs_kernel
@pytest.mark.parametrize("path", ["int8", "fp32"])
def test_the_kernel_breaks_ties_as_the_torch_path(path: str) -> None:
    """Tokens whose logits tie exactly (one-hot x, small integer router weights) take the same
    experts in the kernel as in `route`: the output of the lower ids, far from that of the
    other tied experts."""
    experts, routing = random_experts(("Q8_0",) * 3, 6, 64, 32, seed=3), Routing(6, 2, False)
    router = torch.zeros(6, 64)
    router[[1, 2, 4], 0] = 3.0  # token 0: 1, 2, 4 tie at the top
    router[:, 1] = 1.0  # token 1: all six tie
    router[5, 2], router[1, 2], router[3, 2] = 2.0, 1.0, 1.0  # token 2: 5, then 1 and 3 tie
    x = torch.eye(64)[:3]
    block = MoeBlock(routing, router, experts, block_quant_ops=ops, int8_max_rows=PATHS[path])
    assert block.native
    got = block(x)
    want = reference(x, F.linear(x, router), routing, experts)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-4 * want.abs().amax().item())
    # the same tokens with the other tied experts
    other = reference(x, F.linear(x, router), routing,
                      Experts(*(_permuted(m, [0, 4, 2, 5, 1, 3]) for m in
                                (experts.gate, experts.up, experts.down))))
    assert (other - got).abs().amax() > 10 * (want - got).abs().amax()


def _permuted(m: ExpertBlocks, order: list[int]) -> ExpertBlocks:
    return ExpertBlocks(m.blocks[order], m.kind)


# -- the kernel against the torch path -------------------------------------------------------

def random_experts(kinds: tuple[str, str, str], num_experts: int, hidden: int, inter: int,
                   seed: int) -> Experts:
    """gate, up [E, I, H] and down [E, H, I] of the given kinds: the native ones with random
    codes and fp16 scales (and offsets), the K-quants random valid blocks converted as at
    load (Q4_K to its own blocks, Q6_K quantized again to Q8_0)."""
    shapes = [(num_experts, inter, hidden)] * 2 + [(num_experts, hidden, inter)]
    return Experts(*(random_blocks(kind, shape, seed + i)
                     for i, (kind, shape) in enumerate(zip(kinds, shapes))))


def random_blocks(kind: str, shape: tuple[int, int, int], seed: int) -> ExpertBlocks:
    e, n, k = shape
    gen = torch.Generator().manual_seed(seed)
    if kind in CODES:
        low, high = CODES[kind]
        blocks = (e * n, k // 32)
        offset = (-torch.rand(blocks, generator=gen) * 0.1 if kind == "Q4_1"
                  else torch.zeros(blocks))
        bq = BlockQuantWeight.from_codes(
            codes=torch.randint(low, high, (e * n, k), generator=gen, dtype=torch.int8),
            scale=(torch.rand(blocks, generator=gen) * 0.02 + 0.001).half().float(),
            offset=offset.half().float(), kind=kind)
    else:
        bq = native_blocks(kind, random_gguf_bytes(kind, e * n, k, seed).reshape(e, n, -1),
                           shape)
    return ExpertBlocks(bq.blocks.view(e, n, *bq.blocks.shape[1:]), bq.kind)


def random_gguf_bytes(kind: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """uint8 [rows, bytes per row] of random blocks of a GGUF type, its fp16 fields small
    powers of two (so that every product with a 6-bit sub-scale is an fp16 value)."""
    rng = np.random.default_rng(seed)
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    blocks = rng.integers(0, 256, (rows * cols // block_size, type_size), dtype=np.uint8)
    for start in FP16_FIELDS[kind]:
        values = (2.0 ** rng.integers(-14, -10, len(blocks))).astype(np.float16)
        blocks[:, start:start + 2] = values.view(np.uint16)[:, None].view(np.uint8)
    return blocks.reshape(rows, -1)


def uneven_step(tokens: int, hidden: int, num_experts: int, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, router): feature 0 of every token is 4, which the router weighs +1 for expert 0
    (chosen by nearly every token), -4 for the last expert (chosen by none), 0 for the rest,
    whose loads are uneven and random."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    x[:, 0] = 4.0
    router = torch.randn(num_experts, hidden, generator=gen) / hidden ** 0.5  # logits ~ N(0, 1)
    router[:, 0] = 0.0
    router[0, 0], router[-1, 0] = 1.0, -4.0
    return x, router


KIND_SETS = {"Q4_0": ("Q4_0",) * 3, "Q4_1": ("Q4_1",) * 3, "Q8_0": ("Q8_0",) * 3,
             "Q4_K_M": ("Q4_K", "Q4_K", "Q6_K"), "mixed": ("Q4_1", "Q8_0", "Q4_0")}
# (hidden, intermediate, shared intermediate): K-quant rows are whole blocks of 256
SIZES = {kinds: (256, 256, 256) if kinds == "Q4_K_M" else (96, 64, 96) for kinds in KIND_SETS}


@needs_kernel
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("tokens", [1, 3, 40])
@pytest.mark.parametrize("kinds", list(KIND_SETS))
def test_kernel_matches_the_torch_path(kinds: str, tokens: int, path: str,
                                       shared: bool) -> None:
    """One call per layer against the torch path on the same dequantized weights: a decode
    token, a few, and a prefill-sized step with uneven expert loads and an expert no token
    takes; on the fp32 path to fp32 rounding, on the int8 path (activations in two int8 parts
    per block of 32, twice: x and SiLU * up) to int16-like precision; `auto` mixes them, by
    each expert's rows."""
    num_experts, (hidden, inter, shared_inter) = 8, SIZES[kinds]
    experts = random_experts(KIND_SETS[kinds], num_experts, hidden, inter, seed=tokens)
    shared_expert = None
    if shared:  # its kinds the other way round: gate and up of different widths in "mixed"
        mlp = random_experts(KIND_SETS[kinds][::-1], 1, hidden, shared_inter, seed=50)
        gate = torch.randn(hidden, generator=torch.Generator().manual_seed(5)) * 0.1
        shared_expert = SharedExpert(mlp, gate)
    x, router = uneven_step(tokens, hidden, num_experts, seed=tokens + 7)
    routing = Routing(num_experts, 2, normalize=kinds != "Q4_0")
    ids, _ = route(F.linear(x, router), routing)
    if tokens == 40:
        loads = torch.bincount(ids.flatten(), minlength=num_experts)
        assert loads[0] >= 35 and loads[-1] == 0 and loads[1:-1].max() > loads[1:-1].min()
    block = MoeBlock(routing, router, experts, shared_expert, ops,
                     int8_max_rows=PATHS[path] or {4: 12, 8: 20})
    assert block.native
    want = reference(x, F.linear(x, router), routing, experts, shared_expert)
    got = block(x)
    scale = want.abs().amax().item()
    if path == "fp32":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * scale)
    else:
        torch.testing.assert_close(got, want, rtol=0, atol=3e-4 * scale)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 40])
def test_experts_no_token_chose_are_never_read(tokens: int) -> None:
    """The scales of every expert no token chose set to NaN: the output is the same, to the
    bit (a read of any of their blocks would spread the NaN)."""
    num_experts = 8
    experts = random_experts(KIND_SETS["Q4_1"], num_experts, 96, 64, seed=4)
    x, router = uneven_step(tokens, 96, num_experts, seed=5)
    routing = Routing(num_experts, 2, False)
    ids, _ = route(F.linear(x, router), routing)
    unused = sorted(set(range(num_experts)) - set(ids.flatten().tolist()))
    assert len(unused) >= (1 if tokens == 40 else num_experts - 2)

    def poisoned(m: ExpertBlocks) -> ExpertBlocks:
        blocks = m.blocks.clone()
        blocks[unused, :, :, 0:2] = torch.tensor([0x00, 0x7E], dtype=torch.uint8)  # fp16 NaN
        return ExpertBlocks(blocks, m.kind)

    bad = Experts(poisoned(experts.gate), poisoned(experts.up), poisoned(experts.down))
    assert bad.weights(unused[0], torch.float32)[0].isnan().all()
    want = MoeBlock(routing, router, experts, block_quant_ops=ops)(x)
    got = MoeBlock(routing, router, bad, block_quant_ops=ops)(x)
    assert torch.equal(got, want)


@needs_kernel
def test_the_sums_do_not_depend_on_the_thread_count() -> None:
    """Each output is summed by one thread, in expert order: one thread or two, the same bits."""
    experts = random_experts(KIND_SETS["mixed"], 8, 96, 64, seed=6)
    x, router = uneven_step(40, 96, 8, seed=7)
    block = MoeBlock(Routing(8, 3, True), router, experts, block_quant_ops=ops)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = block(x)
        torch.set_num_threads(1)
        one = block(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@needs_kernel
@pytest.mark.parametrize("path", ["int8", "fp32"])
def test_large_activations_stay_finite(path: str) -> None:
    """Gate pre-activations and shared-gate logits far below -87, where e^-g overflows
    float32: SiLU and the sigmoid gate are 0 there, as torch's are, not NaN."""
    experts = random_experts(KIND_SETS["Q8_0"], 8, 96, 64, seed=16)
    mlp = random_experts(KIND_SETS["Q8_0"], 1, 96, 64, seed=17)
    x, router = uneven_step(24, 96, 8, seed=18)
    x = x * 30
    gate = torch.zeros(96)
    gate[1] = 100.0  # x[:, 1] * 100: beyond +-87 for most tokens, of either sign
    shared = SharedExpert(mlp, gate)
    routing = Routing(8, 2, True)
    want = reference(x, F.linear(x, router), routing, experts, shared)
    assert (x @ gate < -87).any() and want.isfinite().all()
    got = MoeBlock(routing, router, experts, shared, ops, int8_max_rows=PATHS[path])(x)
    torch.testing.assert_close(got, want, rtol=0, atol=3e-4 * want.abs().amax().item())


@needs_kernel
def test_no_tokens_give_no_rows() -> None:
    experts = random_experts(KIND_SETS["Q8_0"], 4, 64, 32, seed=8)
    block = MoeBlock(Routing(4, 2, True), torch.randn(4, 64), experts, block_quant_ops=ops)
    assert block(torch.empty(0, 64)).shape == (0, 64)


@needs_kernel
def test_the_kernel_refuses_panels_that_do_not_fit() -> None:
    experts = random_experts(KIND_SETS["Q8_0"], 4, 64, 32, seed=9)
    block = MoeBlock(Routing(4, 2, True), torch.randn(4, 64), experts, block_quant_ops=ops)
    panels = block._panels
    x, logits = torch.randn(2, 64), torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="top_k"):
        ops.moe_experts(x, logits, 5, True, panels.gate_up, panels.down, None, None, None, 1, 1)
    with pytest.raises(RuntimeError, match="every expert"):
        ops.moe_experts(x, logits, 2, True, panels.gate_up[:3], panels.down[:3], None, None,
                        None, 1, 1)
    with pytest.raises(RuntimeError, match="both"):
        ops.moe_experts(x, logits, 2, True, panels.gate_up, panels.down, panels.gate_up[0],
                        None, None, 1, 1)


def test_experts_that_do_not_fit_the_kernel_run_on_torch() -> None:
    """fp32 experts (a Hugging Face folder, an F16 GGUF) and no kernel: the torch path."""
    gen = torch.Generator().manual_seed(10)
    dense = Experts(torch.randn(4, 32, 64, generator=gen), torch.randn(4, 32, 64, generator=gen),
                    torch.randn(4, 64, 32, generator=gen))
    router = torch.randn(4, 64, generator=gen)
    assert not MoeBlock(Routing(4, 2, True), router, dense, block_quant_ops=ops).native
    quantized = random_experts(KIND_SETS["Q8_0"], 4, 64, 32, seed=11)
    assert not MoeBlock(Routing(4, 2, True), router, quantized, block_quant_ops=None).native
    # --batch-invariant's bounds refuse them: the torch loop's matmuls take what the batch routes
    with pytest.raises(ValueError, match="batch_invariant needs every mixture-of-experts"):
        MoeBlock(Routing(4, 2, True), router, dense, block_quant_ops=ops,
                 int8_max_rows=INT8_EVERY_ROW)


def test_three_d_tensors_convert_as_each_expert_would() -> None:
    """requant's conversion of an [E, N, K] tensor: expert e's rows are what converting its own
    [N, K] slice gives (for Q6_K, which the MoE kernel has no records of, quantized again to
    Q8_0)."""
    for kind in ("Q4_K", "Q6_K"):
        data = random_gguf_bytes(kind, 3 * 16, 256, seed=12).reshape(3, 16, -1)
        stacked = native_blocks(kind, data, (3, 16, 256))
        assert stacked.kind == ("Q8_0" if kind == "Q6_K" else SAME_CODES[kind])
        assert stacked.shape == (48, 256)
        for e in range(3):
            one = native_blocks(kind, np.ascontiguousarray(data[e]), (16, 256))
            want = one.as_q8_0() if kind == "Q6_K" else one
            assert torch.equal(stacked.blocks[16 * e:16 * (e + 1)], want.blocks)


# -- GGUF's stacked expert tensors ------------------------------------------------------------

GGUF_KINDS = {"Q8_0": GGMLQuantizationType.Q8_0, "Q4_0": GGMLQuantizationType.Q4_0,
              "F16": GGMLQuantizationType.F16, "Q4_K": GGMLQuantizationType.Q4_K}


def write_moe_gguf(path: Path, kind: str, merged: bool, shared: bool, seed: int
                   ) -> dict[str, list[np.ndarray]]:
    """Layer 0 of a mixture of experts (4 experts, hidden and intermediate sizes 256: Q4_K's
    rows are whole 256-blocks) as llama.cpp's converter lays it out: each expert's matrices
    stacked experts first (ffn_gate_up_exps where `merged`), the router F32, a shared expert
    as 2-D tensors. Returns each stacked tensor's experts as gguf dequantizes them one by one
    (the F16 ones: the fp16 values)."""
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "qwen2moe")
    per_expert: dict[str, list[np.ndarray]] = {}

    def add(name: str, matrices: list[np.ndarray]) -> None:
        stacked = np.stack(matrices) if name.endswith("exps") else matrices[0]
        qtype = GGUF_KINDS[kind]
        if kind == "Q4_K":
            rows = int(np.prod(stacked.shape[:-1]))
            data = random_gguf_bytes("Q4_K", rows, stacked.shape[-1], seed).reshape(
                *stacked.shape[:-1], -1)
        elif kind == "F16":
            data = stacked.astype(np.float16)
        else:
            data = gguf_quantize(stacked, qtype)
        writer.add_tensor(f"blk.0.{name}.weight", data, raw_dtype=qtype)
        flat = data.reshape(-1, data.shape[-1])
        values = gguf_dequantize(flat, qtype).reshape(stacked.shape)
        per_expert[name] = list(values.reshape(-1, *stacked.shape[-2:]))

    def matrices(rows: int, cols: int, count: int = 4) -> list[np.ndarray]:
        return [rng.standard_normal((rows, cols), dtype=np.float32) * 0.5 for _ in range(count)]

    writer.add_tensor("blk.0.ffn_gate_inp.weight", rng.standard_normal((4, 256), np.float32))
    gate, up = matrices(256, 256), matrices(256, 256)
    if merged:
        add("ffn_gate_up_exps", [np.concatenate([g, u]) for g, u in zip(gate, up)])
    else:
        add("ffn_gate_exps", gate)
        add("ffn_up_exps", up)
    add("ffn_down_exps", matrices(256, 256))
    if shared:
        for name in ("gate", "up", "down"):
            add(f"ffn_{name}_shexp", matrices(256, 256, count=1))
        writer.add_tensor("blk.0.ffn_gate_inp_shexp.weight", rng.standard_normal(256, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return per_expert


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("merged", [False, True])
@pytest.mark.parametrize("kind", list(GGUF_KINDS))
def test_gguf_expert_tensors_read_back_per_expert(kind: str, merged: bool, shared: bool,
                                                  tmp_path: Path) -> None:
    """Stacked tensors read back as each expert's weights, in order; the merged gate_up
    splits into gate then up; the torch path and the native kernel compute the same block from
    them."""
    written = write_moe_gguf(tmp_path / "moe.gguf", kind, merged, shared, seed=13)
    tensors = {t.name: t for t in read_gguf(tmp_path / "moe.gguf").tensors}
    routing = Routing(4, 2, False)
    block = moe_from_gguf(tensors, 0, routing, None)
    assert block.experts is not None and not block.native
    blocks = kind != "F16" and (kind != "Q4_K" or converts_here())
    assert isinstance(block.experts.gate, ExpertBlocks) == blocks
    if merged:
        gate = [m[:256] for m in written["ffn_gate_up_exps"]]
        up = [m[256:] for m in written["ffn_gate_up_exps"]]
    else:
        gate, up = written["ffn_gate_exps"], written["ffn_up_exps"]
    for e in range(4):
        got = block.experts.weights(e, torch.float32)
        for matrix, want in zip(got, (gate[e], up[e], written["ffn_down_exps"][e])):
            np.testing.assert_array_equal(matrix.numpy(), want)
    assert (block.shared is not None) == shared
    if shared:
        got = block.shared.mlp.weights(0, torch.float32)
        for matrix, name in zip(got, ("gate", "up", "down")):
            np.testing.assert_array_equal(matrix.numpy(), written[f"ffn_{name}_shexp"][0])
    if ops is None or not ops.supported() or not blocks:
        return
    native = moe_from_gguf(tensors, 0, routing, ops)
    assert native.native
    x = torch.randn(9, 256, generator=torch.Generator().manual_seed(14))
    want = block(x)
    torch.testing.assert_close(native(x), want, rtol=0, atol=3e-4 * want.abs().amax().item())


def test_a_gguf_layer_without_experts_is_named(tmp_path: Path) -> None:
    write_moe_gguf(tmp_path / "moe.gguf", "Q8_0", merged=False, shared=False, seed=15)
    tensors = {t.name: t for t in read_gguf(tmp_path / "moe.gguf").tensors}
    del tensors["blk.0.ffn_down_exps.weight"]
    with pytest.raises(ValueError, match="ffn_down_exps"):
        moe_from_gguf(tensors, 0, Routing(4, 2, False), ops)


# -- benchmarks/synthetic_gguf.py's mixtures of experts ---------------------------------------

def write_reference(path: Path) -> None:
    """A Llama GGUF with a 40-token vocabulary and no weights: what the synthetic file takes
    its tokenizer and settings from."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.context_length", 512)
    writer.add_uint32("llama.embedding_length", 8)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", [f"t{i}" for i in range(40)])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["qwen3moe", "olmoe", "llama"])
def test_synthetic_gguf_writes_the_architectures_tensors(arch: str, tmp_path: Path) -> None:
    """The file names its keys after its architecture (the reference's taken over, the sizes
    its own), holds the tensors llama.cpp's loader of the architecture asks for, and loom
    builds each layer's experts from them."""
    write_reference(tmp_path / "ref.gguf")
    moe = arch != "llama"
    shape = synthetic_gguf.Shape(arch, hidden=64, ffn=32 if arch == "olmoe" else 96, layers=2,
                            heads=4, kv_heads=2, head_dim=32 if arch == "qwen3moe" else 16,
                            experts=8 if moe else 0, experts_used=2 if moe else 0,
                            expert_ffn=32 if moe else 0)
    synthetic_gguf.write(shape, str(tmp_path / "ref.gguf"), str(tmp_path / "out.gguf"))
    out = read_gguf(tmp_path / "out.gguf")
    meta, tensors = out.metadata, {t.name: t for t in out.tensors}
    assert meta["general.architecture"] == arch and len(meta["tokenizer.ggml.tokens"]) == 40
    assert meta[f"{arch}.context_length"] == 512 and meta[f"{arch}.embedding_length"] == 64
    assert arch == "llama" or not any(key.startswith("llama.") for key in meta)
    q = shape.heads * shape.head_dim
    assert tensors["blk.1.attn_q.weight"].shape == (q, 64)
    assert tensors["token_embd.weight"].shape == (40, 64)
    assert ("output.weight" in tensors) == moe
    if not moe:
        assert tensors["blk.1.ffn_down.weight"].shape == (64, 96)
        return
    assert meta[f"{arch}.expert_count"] == 8 and meta[f"{arch}.expert_used_count"] == 2
    assert meta[f"{arch}.expert_feed_forward_length"] == 32
    norm = (32,) if arch == "qwen3moe" else (q,)  # per head, or over the whole projection
    assert tensors["blk.0.attn_q_norm.weight"].shape == norm
    assert tensors["blk.1.ffn_gate_exps.weight"].shape == (8, 32, 64)
    assert tensors["blk.1.ffn_down_exps.weight"].kind == "F16"
    for layer in range(2):
        block = moe_from_gguf(tensors, layer, Routing(8, 2, True), ops)
        assert block(torch.randn(3, 64)).isfinite().all()


def test_synthetic_gguf_refuses_shapes_llama_cpp_would_not_load() -> None:
    with pytest.raises(ValueError, match="--expert-ffn"):
        synthetic_gguf.Shape("olmoe", 64, 64, 1, 4, 4, 16, experts=8, experts_used=2, expert_ffn=32)
    with pytest.raises(ValueError, match="--experts-used"):
        synthetic_gguf.Shape("qwen3moe", 64, 64, 1, 4, 4, 16, experts=8, experts_used=9,
                        expert_ffn=32)
    with pytest.raises(ValueError, match="no experts"):
        synthetic_gguf.Shape("llama", 64, 64, 1, 4, 4, 16, experts=8)
