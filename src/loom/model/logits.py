"""What the sampler does to rows of logits: penalties and logit bias, a grammar's mask, top-k
and top-p, and the two ways a row becomes a token (its argmax, or a uniform draw located in
its cumulative distribution)."""

from __future__ import annotations

from dataclasses import dataclass

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


# How many of a row's likeliest tokens top-k / top-p look at first. A sampled row's nucleus is
# almost always a few of them (at temperature 0.2 a handful); a full sort of a 49k vocabulary
# cost 3-4 ms a row on one core (117 ms for 32 rows, more than a 32-sequence decode step's
# forward pass), the 256 largest 0.18 ms. A batch with a row whose kept set reaches past them
# is sorted whole.
NUCLEUS_CANDIDATES = 256


@dataclass(frozen=True)
class KeptTokens:
    """Each row's candidates, likeliest first: their logits, -inf for those top-k / top-p
    drop, and their token ids (both [rows, width])."""

    logits: torch.Tensor
    token_ids: torch.Tensor

    def draw(self, uniform: torch.Tensor) -> torch.Tensor:
        """One token id per row, by its uniform draw ([rows, 1]) in the kept distribution."""
        drawn = inverse_cdf(self.logits.softmax(dim=-1), uniform)
        return self.token_ids.gather(1, drawn.unsqueeze(1)).squeeze(1)


def has_limits(top_k: int, top_p: float) -> bool:
    return top_k > 0 or top_p < 1.0


def keep_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> KeptTokens:
    """Each row's top-k and nucleus (top-p) set: of the tokens in its top k, by falling
    probability (renormalised over those k), each one whose mass before it is below top_p,
    and always the likeliest. Decided among the NUCLEUS_CANDIDATES likeliest tokens where
    that decides every row, else over the whole sorted row."""
    vocab = logits.shape[-1]
    ks = [k if 0 < k < vocab else vocab for k in top_k]
    width = min(vocab, max([NUCLEUS_CANDIDATES, *(k for k in ks if k < vocab)]))
    if width < vocab:
        kept, decided = _keep_among_likeliest(logits, width, ks, top_p)
        if decided:
            return kept
    return _keep_among_likeliest(logits, vocab, ks, top_p)[0]


def _keep_among_likeliest(logits: torch.Tensor, width: int, ks: list[int], top_p: list[float]
                          ) -> tuple[KeptTokens, bool]:
    """The kept sets among each row's `width` likeliest tokens, and whether that decided every
    row: its top k lie among them, or its nucleus closes there (their mass reaches top_p, so
    the next token would be dropped too)."""
    if width < logits.shape[-1]:
        values, token_ids = logits.topk(width, dim=-1)
    else:
        values, token_ids = logits.sort(dim=-1, descending=True)
    k = torch.tensor(ks, device=logits.device).unsqueeze(1)
    p = torch.tensor(top_p, device=logits.device, dtype=logits.dtype).unsqueeze(1)
    drop = torch.arange(width, device=logits.device).unsqueeze(0) >= k
    masked = values.masked_fill(drop, float("-inf"))
    # normalised over the row's top k: these tokens where k fits among them, else the whole row
    probs = masked.softmax(dim=-1)
    if bool((k > width).any()):
        probs = torch.where(k <= width, probs, logits.softmax(dim=-1).gather(1, token_ids))
    mass_before = probs.cumsum(dim=-1) - probs
    drop |= mass_before >= p
    drop[:, 0] = False  # the likeliest token stays, whatever top_p rounds to in float32
    decided = bool(((k <= width) | (probs.sum(dim=-1, keepdim=True) >= p)).all())
    return KeptTokens(values.masked_fill(drop, float("-inf")), token_ids), decided


def apply_top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """`logits` with -inf outside each row's kept set (keep_top_k_top_p); rows of a batch
    without limits (top_k -1, top_p 1) are left as they are."""
    if not any(has_limits(k, p) for k, p in zip(top_k, top_p)):
        return logits
    kept = keep_top_k_top_p(logits, top_k, top_p)
    return torch.full_like(logits, float("-inf")).scatter_(-1, kept.token_ids, kept.logits)


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
