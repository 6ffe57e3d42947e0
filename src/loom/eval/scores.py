"""What scoring a chunk gives: per scored token its log-probability and the distribution it
was drawn from, whole (the offline engine: every token's log-probability) or its top N (a
server's `logprobs: N`, the rest of the mass implied)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ChunkScores:
    """One chunk's scored tokens. `logprobs` is [n, V], the full log-softmax, when `top_ids`
    is None; else [n, K], the log-probabilities of the ids in `top_ids` (-inf, id -1 where a
    row has fewer than K)."""

    targets: np.ndarray  # int64 [n]: the tokens that came next
    target_logprobs: np.ndarray  # float64 [n]: log p(target)
    logprobs: np.ndarray
    top_ids: np.ndarray | None = None

    @property
    def full(self) -> bool:
        return self.top_ids is None

    @property
    def vocab_size(self) -> int | None:
        return self.logprobs.shape[1] if self.full else None

    def top1(self) -> np.ndarray:
        """The likeliest token at each scored position."""
        best = self.logprobs.argmax(axis=1)
        return best if self.top_ids is None else self.top_ids[np.arange(len(best)), best]

    @classmethod
    def from_full(cls, targets: np.ndarray, logprobs: np.ndarray) -> ChunkScores:
        targets = np.asarray(targets, dtype=np.int64)
        return cls(targets, logprobs[np.arange(len(targets)), targets].astype(np.float64),
                   logprobs)
