"""Mixture-of-experts arithmetic for planning: how many experts a step touches, and so how
many expert weight bytes a decode step reads.

Each of B tokens routes to k of a layer's E experts. Taking the choices as independent and
uniform (a router trained with a load-balancing loss spreads tokens about evenly), a given
expert is missed by all B tokens with probability (1 - k/E)^B, so the expected number of
distinct experts touched per layer is E * (1 - (1 - k/E)^B): k for one token, growing with
the batch and never above E. A step reads the weights of the experts it touches only, which
is why a batch-64 decode of Mixtral reads all eight experts while one token reads two.
Real routing is skewed (hot experts), which touches fewer distinct experts than this: the
figure is an upper estimate of the bytes at a given batch.
"""

from __future__ import annotations


def expert_coverage(tokens: int, num_experts: int, experts_per_tok: int) -> float:
    """Expected share of a layer's experts that `tokens` tokens touch (0 for none)."""
    if tokens <= 0 or num_experts <= 0:
        return 0.0
    return 1.0 - (1.0 - experts_per_tok / num_experts) ** tokens


def distinct_experts(tokens: int, num_experts: int, experts_per_tok: int) -> float:
    """E * (1 - (1 - k/E)^B): expected distinct experts per layer for B tokens."""
    return num_experts * expert_coverage(tokens, num_experts, experts_per_tok)
