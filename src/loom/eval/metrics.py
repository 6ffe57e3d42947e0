"""Perplexity and KL divergence over scored chunks, as llama-perplexity reports them.

Perplexity is exp of the mean negative log-probability of every scored token (all chunks
together; each chunk's own too). KL divergence is KL(reference || tested) at each scored
position, the reference's distribution P and the tested one's Q: sum_i P_i (log P_i - log Q_i);
its mean and 99th percentile over positions, with top-1 agreement (the share of positions where
both put the same token first) and the change in perplexity, as `llama-perplexity
--kl-divergence` prints them.

When one side has only its top N (a server's logprobs), the sum runs over those N tokens and
one more bucket, the rest of the vocabulary, whose mass is 1 - the sum of the N on each side:
a lower bound on the exact divergence (merging tokens never increases it). Both sides top-N
only cannot be compared (their buckets differ), and is refused.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from loom.eval.scores import ChunkScores


@dataclass(frozen=True)
class ChunkPerplexity:
    index: int
    tokens: int
    perplexity: float


@dataclass(frozen=True)
class PerplexityResult:
    """A text's perplexity: over all scored tokens, and chunk by chunk."""

    perplexity: float
    tokens: int
    context: int
    chunks: list[ChunkPerplexity]


@dataclass(frozen=True)
class KldResult:
    """How far the tested distributions are from the reference's (see the module docstring)."""

    mean_kld: float
    p99_kld: float
    max_kld: float
    top1_agreement: float  # share of positions, 0..1
    perplexity: float
    reference_perplexity: float
    delta_perplexity: float  # tested - reference
    tokens: int
    exact: bool  # False: over the top N and the rest's mass (a lower bound)


def perplexity(scored: Iterable[ChunkScores], context: int) -> PerplexityResult:
    """Over a stream of chunks: only each chunk's target log-probabilities are kept."""
    logprobs = [s.target_logprobs for s in scored]
    per_chunk = [ChunkPerplexity(i, len(lp), math.exp(-float(lp.mean())))
                 for i, lp in enumerate(logprobs)]
    every = np.concatenate(logprobs)
    return PerplexityResult(math.exp(-float(every.mean())), len(every), context, per_chunk)


def kl_divergence(reference: Iterable[ChunkScores], tested: Iterable[ChunkScores]
                  ) -> KldResult:
    """Compare chunk by chunk, as both streams yield them (only a chunk's distributions are
    held at a time, and per position its divergence); the two must have scored the same
    tokens with the same vocabulary, else a ValueError says which differs."""
    per_position, agree, ref_lp, test_lp, exact = [], 0, [], [], True
    for ref, test in itertools.zip_longest(reference, tested):
        if ref is None or test is None:
            raise ValueError("the reference and the tested run scored different numbers of "
                             "chunks: give both the same text, --context and --stride")
        check_comparable(ref, test)
        per_position.append(position_kld(ref, test))
        agree += int((ref.top1() == test.top1()).sum())
        ref_lp.append(ref.target_logprobs)
        test_lp.append(test.target_logprobs)
        exact = exact and ref.full and test.full
    kld = np.concatenate(per_position)
    ref_ppl = math.exp(-float(np.concatenate(ref_lp).mean()))
    test_ppl = math.exp(-float(np.concatenate(test_lp).mean()))
    return KldResult(float(kld.mean()), float(np.percentile(kld, 99)), float(kld.max()),
                     agree / len(kld), test_ppl, ref_ppl, test_ppl - ref_ppl, len(kld), exact)


def check_comparable(ref: ChunkScores, test: ChunkScores) -> None:
    if ref.full and test.full and ref.vocab_size != test.vocab_size:
        raise ValueError(f"the reference's vocabulary has {ref.vocab_size} tokens, the tested "
                         f"model's {test.vocab_size}: KL divergence needs one vocabulary")
    if not np.array_equal(ref.targets, test.targets):
        raise ValueError("the reference and the tested model tokenized the text differently "
                         "(another vocabulary?): KL divergence needs the same tokens")
    if not (ref.full or test.full):
        raise ValueError("both sides have only their top-N log-probabilities; one of them "
                         "(the reference, usually) must be scored in full, offline")


def position_kld(ref: ChunkScores, test: ChunkScores) -> np.ndarray:
    """KL(ref || test) at each scored position, exact or over top-N buckets."""
    if ref.full and test.full:
        p_log, q_log = _normalized(ref.logprobs), _normalized(test.logprobs)
        return (np.exp(p_log) * (p_log - q_log)).sum(axis=1)
    if ref.full:
        return _bucketed(_gather(ref.logprobs, test.top_ids), test.logprobs)
    return _bucketed(ref.logprobs, _gather(test.logprobs, ref.top_ids))


def _normalized(logprobs: np.ndarray) -> np.ndarray:
    """Rows renormalized in float64: float32 (or a saved file's float16) log-probabilities sum
    to one only within their rounding, and the divergence's first-order term must cancel."""
    values = logprobs.astype(np.float64)
    top = values.max(axis=1, keepdims=True)
    return values - top - np.log(np.exp(values - top).sum(axis=1, keepdims=True))


def _gather(full: np.ndarray, ids: np.ndarray) -> np.ndarray:
    values = np.take_along_axis(full, np.maximum(ids, 0), axis=1).astype(np.float64)
    return np.where(ids >= 0, values, -np.inf)


def _bucketed(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """KL over the given columns plus one bucket of what is left of each row's mass."""
    p_log, q_log = p_log.astype(np.float64), q_log.astype(np.float64)
    p, q = np.exp(p_log), np.exp(q_log)
    with np.errstate(invalid="ignore", divide="ignore"):
        terms = np.where(p > 0, p * (p_log - q_log), 0.0).sum(axis=1)
        p_tail = np.clip(1 - p.sum(axis=1), 1e-12, 1.0)
        q_tail = np.clip(1 - q.sum(axis=1), 1e-12, 1.0)
    return terms + p_tail * (np.log(p_tail) - np.log(q_tail))
