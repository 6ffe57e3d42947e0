"""`--save-logits FILE`: a run's scored distributions, to compare later runs against.

One .npz (numpy's zip of .npy arrays) holding, per chunk i, `targets_i` (the scored tokens),
`target_logprobs_i` (float64) and `logprobs_i`: the full log-softmax as float16 (2 bytes a
vocabulary entry a token: exact KL divergence needs every token's probability; a top-k with
the log-sum-exp does not give it), or, from a server, the top-N with `top_ids_i`. float16 keeps
log-probabilities to about 3 significant digits, which moves a KL divergence far less than the
settings it is used to compare, once metrics.py renormalizes each row. `meta` is a
JSON header: the format version, context, stride and how many chunks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from loom.eval.scores import ChunkScores

FORMAT = "loom-eval-logits/1"


@dataclass(frozen=True)
class LogitsMeta:
    context: int
    stride: int
    chunks: int
    model: str
    format: str = FORMAT


def save(path: str | Path, meta: LogitsMeta, scored: list[ChunkScores]) -> None:
    arrays: dict[str, np.ndarray] = {"meta": np.array(json.dumps(asdict(meta)))}
    for i, s in enumerate(scored):
        arrays[f"targets_{i}"] = s.targets
        arrays[f"target_logprobs_{i}"] = s.target_logprobs
        arrays[f"logprobs_{i}"] = s.logprobs.astype(np.float16) if s.full else s.logprobs
        if s.top_ids is not None:
            arrays[f"top_ids_{i}"] = s.top_ids
    with open(path, "wb") as f:  # np.savez would add .npz to a name without it
        np.savez(f, **arrays)


def is_logits_file(path: str | Path) -> bool:
    return Path(path).is_file() and str(path).endswith(".npz")


def load(path: str | Path) -> tuple[LogitsMeta, list[ChunkScores]]:
    """The saved run; a file that is not one is a ValueError naming it."""
    try:
        data = np.load(path, allow_pickle=False)
        meta = LogitsMeta(**json.loads(str(data["meta"])))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a file --save-logits wrote ({e})") from None
    if meta.format != FORMAT:
        raise ValueError(f"{path}: format {meta.format!r}, this loom reads {FORMAT!r}")
    scored = []
    for i in range(meta.chunks):
        top = data[f"top_ids_{i}"] if f"top_ids_{i}" in data else None
        logprobs = data[f"logprobs_{i}"]
        scored.append(ChunkScores(data[f"targets_{i}"], data[f"target_logprobs_{i}"],
                                  logprobs.astype(np.float32) if top is None else logprobs,
                                  top))
    return meta, scored

