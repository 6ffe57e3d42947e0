"""Verify draft tokens (speculative decoding) against the model's own distribution.

Row i of `logits` is the model's prediction after the request's token i of this step: row 0
follows the last real token and is checked against draft 1, row k (the last) follows draft k.
A draft is kept while the model agrees; the first disagreement is replaced by a token drawn
from the model, and if every draft is kept the last row yields one more token. The output
therefore has exactly the distribution of sampling one token at a time:

- greedy: a draft is kept iff it is the row's argmax, and the replacement is the argmax, so
  the tokens are those of plain greedy decoding;
- random: the draft distribution is a point mass on the draft d (an n-gram guess), so the
  standard rejection rule keeps d with probability p(d) and otherwise draws from p with d
  removed (p renormalised), p being the row's distribution after temperature, top-k, top-p.
"""

from __future__ import annotations

import torch

from loom.model.logits import apply_top_k_top_p, inverse_cdf, row_argmax
from loom.sampling import SamplingParams


def verify_drafts(logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                  generator: torch.Generator | None) -> tuple[list[int], int]:
    """(the accepted drafts, the token that follows them) for one request; `logits` has
    len(drafts) + 1 rows."""
    logits = logits.float()
    if params.greedy:
        choices = row_argmax(logits).tolist()
        accepted = 0
        while accepted < len(drafts) and choices[accepted] == drafts[accepted]:
            accepted += 1
        return drafts[:accepted], choices[accepted]
    rows = len(drafts) + 1
    scaled = logits / params.temperature
    probs = apply_top_k_top_p(scaled, [params.top_k] * rows,
                               [params.top_p] * rows).softmax(dim=-1)
    draws = torch.rand(rows, device=logits.device, generator=generator)
    for i, draft in enumerate(drafts):
        if draws[i] < probs[i, draft]:
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        return drafts[:i], _draw(residual, generator)
    return drafts, _draw(probs[-1], generator)


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from an unnormalised distribution, by the sampler's inverse CDF."""
    uniform = torch.rand(1, 1, device=probs.device, generator=generator)
    return int(inverse_cdf(probs.unsqueeze(0), uniform)[0])
