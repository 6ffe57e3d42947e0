"""`--base-url`: scoring chunks on any OpenAI-compatible server through /v1/completions with
`echo: true, logprobs: N, max_tokens: 0` (lm-eval's way): the prompt comes back with each
token's log-probability and the N likeliest at each position, `batch_size` requests in flight.

A server names its top tokens by their text, not their ids; each text is mapped back through
the model's own vocabulary. A text that several ids share (a piece of a UTF-8 character, say)
is left out of the listed tokens, so its mass falls into the rest on both sides of the KL
divergence, which stays a like-for-like comparison (metrics.py: top-N buckets).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import numpy as np

from loom.config import server_root
from loom.eval.scores import ChunkScores
from loom.eval.text import Chunk
from loom.model.tokenizer import Tokenizer


class ServerScorer:
    def __init__(self, base_url: str, tokenizer: Tokenizer, top_n: int,
                 api_key: str | None = None, timeout: float = 600.0) -> None:
        self.base_url = server_root(base_url)
        self.tokenizer = tokenizer
        self.top_n = top_n
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers, timeout=timeout)
        self.model = self._model_id()

    def _model_id(self) -> str:
        try:
            response = self.http.get(f"{self.base_url}/v1/models")
            response.raise_for_status()
            return response.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            raise ValueError(f"--base-url {self.base_url}: no OpenAI-compatible server "
                             f"answered /v1/models ({e})") from None

    @functools.cached_property
    def _ids_of_text(self) -> dict[str, int]:
        """Each token text that exactly one id of the vocabulary has -> that id."""
        seen: dict[str, int] = {}
        shared: set[str] = set()
        for token_id in range(self.tokenizer.vocab_size):
            text = self.tokenizer.id_to_token(token_id)
            if text in seen:
                shared.add(text)
            seen[text] = token_id
        return {text: i for text, i in seen.items() if text not in shared}

    def score(self, chunks: list[Chunk], batch_size: int) -> Iterator[ChunkScores]:
        with ThreadPoolExecutor(batch_size) as pool:
            yield from pool.map(self._score_one, chunks)

    def _score_one(self, chunk: Chunk) -> ChunkScores:
        body = {"model": self.model, "prompt": chunk.token_ids, "echo": True,
                "logprobs": self.top_n, "max_tokens": 0, "temperature": 0.0}
        response = self.http.post(f"{self.base_url}/v1/completions", json=body)
        if response.status_code != 200:
            raise ValueError(f"--base-url: /v1/completions answered {response.status_code}: "
                             f"{response.text[:300]}")
        logprobs = response.json()["choices"][0].get("logprobs") or {}
        if "token_logprobs" not in logprobs:
            raise ValueError("--base-url: the server sent no legacy logprobs of the echoed "
                             "prompt (llama-server, for one, scores generated tokens only)")
        return self._scores(chunk, logprobs)

    def _scores(self, chunk: Chunk, logprobs: dict[str, Any]) -> ChunkScores:
        tokens = logprobs["token_logprobs"][chunk.first_scored:len(chunk.token_ids)]
        tops = logprobs["top_logprobs"][chunk.first_scored:len(chunk.token_ids)]
        if len(tokens) != len(chunk.targets) or any(t is None for t in tokens):
            raise ValueError("--base-url: the server echoed fewer prompt log-probabilities "
                             f"than the {len(chunk.token_ids)} tokens sent")
        width = max(len(t) for t in tops)
        ids = np.full((len(tops), width), -1, dtype=np.int64)
        values = np.full((len(tops), width), -np.inf)
        for row, top in enumerate(tops):
            known = [(self._ids_of_text[k], v) for k, v in top.items() if k in self._ids_of_text]
            ids[row, :len(known)] = [i for i, _ in known]
            values[row, :len(known)] = [v for _, v in known]
        return ChunkScores(np.array(chunk.targets, dtype=np.int64),
                           np.array(tokens, dtype=np.float64), values, ids)
