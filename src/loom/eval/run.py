"""A text scored end to end: read, tokenized, chunked, scored offline or on a server."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from loom.config import EngineConfig
from loom.eval.config import ScoringConfig
from loom.eval.scores import ChunkScores
from loom.eval.text import chunks, read_text


@dataclass(frozen=True)
class ScoredText:
    """A text's chunk scores as a stream: scoring runs as it is read, `batch_size` chunks at
    a time, so a whole text's distributions are never all in memory."""

    scored: Iterator[ChunkScores]
    vocab_size: int | None  # the width of a full distribution (None: a server's top-N)


def score_text(text_path: str | None, scoring: ScoringConfig, config: EngineConfig,
               base_url: str | None = None, api_key: str | None = None,
               expect_vocab: int | None = None) -> ScoredText:
    """Score `text_path` (the bundled text when None) with the engine of `config` in this
    process, or on the server at `base_url` (config.model.model then names its tokenizer).
    `expect_vocab`: the reference's vocabulary size, checked before any scoring. Bad input
    fails here; the scoring itself runs as `scored` is read."""
    text = read_text(text_path)  # bad input fails before the model loads
    if base_url is not None:
        from loom.eval.client import ServerScorer
        from loom.model.arch import default_model_path
        from loom.model.model_files import read_tokenizer

        tokenizer = read_tokenizer(config.model.model or default_model_path())
        if expect_vocab is not None and tokenizer.vocab_size > expect_vocab:
            _check_vocab(tokenizer.vocab_size, expect_vocab)
        scorer = ServerScorer(base_url, tokenizer, scoring.top_n, api_key)
        vocab = None
    else:
        from loom.eval.offline import OfflineScorer, scoring_engine

        scorer = OfflineScorer(scoring_engine(config, scoring))
        _check_vocab(scorer.vocab_size, expect_vocab)
        vocab = scorer.vocab_size
    tokenizer = scorer.tokenizer
    bos = tokenizer.bos_token_id if tokenizer.add_bos_token else None
    cut = chunks(tokenizer.encode(text, add_special_tokens=False), scoring.context,
                 scoring.stride, scoring.max_chunks, bos)
    return ScoredText(scorer.score(cut, scoring.batch_size), vocab)


def _check_vocab(vocab: int, expected: int | None) -> None:
    if expected is not None and vocab != expected:
        raise ValueError(f"the model's vocabulary has {vocab} tokens, the reference's "
                         f"{expected}: KL divergence needs the same vocabulary")
