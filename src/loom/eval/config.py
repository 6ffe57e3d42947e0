"""How a text is scored: its chunks and how many share a step (torch-free, no argparse;
`loom eval`'s flags are generated from these fields)."""

from __future__ import annotations

from dataclasses import dataclass

from loom.config import option, require_at_least


@dataclass(frozen=True)
class ScoringConfig:
    CLI_GROUP = "Scoring"

    context: int = option(512,
        "tokens per chunk (llama-perplexity's -c); the second half of each is scored")
    stride: int | None = option(None,
        "tokens between chunk starts; default: --context (non-overlapping chunks, as "
        "llama.cpp); --context / 2 scores every token after the first half-chunk once")
    max_chunks: int | None = option(None,
        "score at most this many chunks (llama-perplexity's --chunks); default: all")
    batch_size: int = option(1,
        "chunks in flight together, sharing each step (so batch effects show)")
    as_decode: bool = option(False,
        "a step budget of --batch-size tokens, so every matmul has as many rows as "
        "decoding --batch-size sequences does (the scheduler fills the budget from the "
        "first chunks waiting, so attention is not a decode's); default: chunks prefill "
        "as the engine's budget allows")
    top_n: int = option(20,
        "with --base-url: the server's logprobs per token (OpenAI's legacy `logprobs`)")

    def __post_init__(self) -> None:
        require_at_least(1, {"--batch-size": self.batch_size, "--max-chunks": self.max_chunks})
        if not 1 <= self.top_n <= 20:
            raise ValueError(f"--top-n must be in [1, 20], got {self.top_n}")
