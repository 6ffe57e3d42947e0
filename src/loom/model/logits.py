"""What the sampler does to rows of logits: penalties and logit bias, a grammar's mask, top-k
and top-p, and the two ways a row becomes a token (its argmax, or a uniform draw located in
its cumulative distribution)."""

from __future__ import annotations

import numpy as np
import torch

from loom.sampling import SamplingParams


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The first index of each row's largest value, as `argmax(dim=-1)`. On a CPU, numpy's
    vectorised argmax: torch's scalar one was a visible part of a batched decode step
    (benchmarks/kernels/op_costs.py times both)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32:
        return logits.argmax(dim=-1)
    return torch.from_numpy(np.argmax(logits.contiguous().numpy(), axis=1))


def inverse_cdf(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One token per row of (unnormalised) probabilities, located by that row's uniform draw
    ([rows, 1]) in its cumulative distribution."""
    cdf = probs.cumsum(dim=-1)
    # right=True: the first token whose cumulative mass exceeds the draw, so a token of zero
    # probability (flat cdf) is never chosen.
    drawn = torch.searchsorted(cdf, uniform * cdf[:, -1:], right=True).squeeze(1)
    # Rounding can put the draw at the very top: take the last token with mass.
    return torch.where(drawn < cdf.shape[-1], drawn, cdf.argmax(dim=-1))


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Mask logits outside each row's top-k and nucleus (top-p) set with -inf."""
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    vocab = logits.shape[-1]
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([k if k > 0 else vocab for k in top_k], device=logits.device)
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    drop = ranks >= ks.unsqueeze(1)
    ps = torch.tensor(top_p, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop |= mass_before >= ps
    drop[:, 0] = False  # the likeliest token stays, whatever top_p rounds to in float32
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, sorted_idx, sorted_logits)


def adjust_logits(logits: torch.Tensor, params: list[SamplingParams],
                  outputs: list[list[int]], prompts: list[list[int]],
                  banned: list[tuple[int, ...]]) -> torch.Tensor:
    """Row i adjusted as params[i] asks, in a copy (`logits` may be the model's, which
    logprobs read; rows that ask nothing pass as they are): vLLM's repetition penalty (the
    logits of tokens in prompts[i] or outputs[i] divided by it where positive, multiplied
    where negative), OpenAI's frequency and presence penalties (minus frequency x count and
    presence once, for each token in outputs[i], the tokens generated so far), logit_bias
    (added), and banned[i] (-inf: EOS and stop tokens before min_tokens)."""
    rows = [i for i, p in enumerate(params) if p.adjusts_logits or banned[i]]
    if not rows:
        return logits
    logits = logits.clone()
    device = logits.device
    for i in rows:
        p, row = params[i], logits[i]
        if banned[i]:
            row[torch.tensor(banned[i], device=device)] = float("-inf")
        if p.repetition_penalty != 1.0 and (prompts[i] or outputs[i]):
            seen = torch.tensor(sorted({*prompts[i], *outputs[i]}), device=device)
            values = row[seen]
            row[seen] = torch.where(values > 0, values / p.repetition_penalty,
                                    values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and outputs[i]:
            ids, counts = torch.tensor(outputs[i], device=device).unique(return_counts=True)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), device=device)
    return logits


_MASK_BIAS = np.array([-np.inf, 0.0], dtype=np.float32)  # disallowed, allowed


def apply_token_bitmask(logits: torch.Tensor, bitmask: np.ndarray) -> torch.Tensor:
    """`logits` with -inf wherever the row's bitmask (int32 [rows, ceil(vocab / 32)], bit j of
    word w for token 32 w + j) disallows the token (structured outputs). Unpacked by numpy and
    added as a 0 / -inf bias: on a CPU that took half the time of torch's masked_fill, and a
    third of unpacking the bits with torch shifts (benchmarks/engine/structured.py's apply)."""
    bits = np.unpackbits(np.ascontiguousarray(bitmask).view(np.uint8), axis=1,
                         bitorder="little")
    vocab = logits.shape[-1]
    if bits.shape[1] < vocab:  # logits padded past the tokenizer's vocabulary
        bits = np.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    bias = torch.from_numpy(_MASK_BIAS[bits[:, :vocab]]).to(logits.device)
    return logits + bias
