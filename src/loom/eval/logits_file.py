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
import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
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


def saving(path: str | Path, meta: LogitsMeta, scored: Iterable[ChunkScores]
           ) -> Iterator[ChunkScores]:
    """`scored`, passed on chunk by chunk as each is written to `path` (the header last,
    once the chunks are counted): a whole text is never in memory."""
    with zipfile.ZipFile(path, "w", allowZip64=True) as zf:
        count = 0
        for i, s in enumerate(scored):
            _write(zf, f"targets_{i}", s.targets)
            _write(zf, f"target_logprobs_{i}", s.target_logprobs)
            _write(zf, f"logprobs_{i}", s.logprobs.astype(np.float16) if s.full else s.logprobs)
            if s.top_ids is not None:
                _write(zf, f"top_ids_{i}", s.top_ids)
            count += 1
            yield s
        _write(zf, "meta", np.array(json.dumps(asdict(replace(meta, chunks=count)))))


def _write(zf: zipfile.ZipFile, name: str, array: np.ndarray) -> None:
    with zf.open(f"{name}.npy", "w", force_zip64=True) as f:  # np.load's .npz layout
        np.lib.format.write_array(f, np.asarray(array), allow_pickle=False)


def is_logits_file(path: str | Path) -> bool:
    return Path(path).is_file() and str(path).endswith(".npz")


@dataclass(frozen=True)
class SavedLogits:
    """A saved run, read chunk by chunk as it is iterated."""

    path: str
    meta: LogitsMeta
    vocab_size: int | None  # None: a server's top-N

    def __iter__(self) -> Iterator[ChunkScores]:
        data = np.load(self.path, allow_pickle=False)
        for i in range(self.meta.chunks):
            top = data[f"top_ids_{i}"] if f"top_ids_{i}" in data else None
            logprobs = data[f"logprobs_{i}"]
            yield ChunkScores(data[f"targets_{i}"], data[f"target_logprobs_{i}"],
                              logprobs.astype(np.float32) if top is None else logprobs, top)


def load(path: str | Path) -> SavedLogits:
    """The saved run; a file that is not one is a ValueError naming it."""
    try:
        data = np.load(path, allow_pickle=False)
        meta = LogitsMeta(**json.loads(str(data["meta"])))
        full = "top_ids_0" not in data
        vocab = data["logprobs_0"].shape[1] if full and meta.chunks else None
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not a file --save-logits wrote ({e})") from None
    if meta.format != FORMAT:
        raise ValueError(f"{path}: format {meta.format!r}, this loom reads {FORMAT!r}")
    return SavedLogits(str(path), meta, vocab)
