"""Synthetic prompts that keep what a server's performance depends on and nothing else.

A server's speed on a request depends on its token counts and on which of its KV blocks it
shares with earlier requests (prefix caching), not on the words. So a prompt is cut into
blocks of `block_size` tokens, each block named by a chained hash of its content and all
blocks before it (the way a prefix cache names them), and every distinct block is replaced
by synthetic whole-word tokens drawn from a generator seeded by that name: the same blocks
give the same synthetic text, different ones different text, and the lengths are the
original's. The synthetic words never include a word of any input, so the trace can be shared.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable
from dataclasses import replace

from loom.workload.tokens import PromptSynth
from loom.workload.trace import Trace

DEFAULT_BLOCK_SIZE = 16  # loom's (and vLLM's) KV block: the unit a prefix cache shares

_WORDS = re.compile(r"[a-z]+")


def words_of(texts: Iterable[str]) -> set[str]:
    """Every word of the texts, lower-cased: what synthetic text must not contain."""
    return {w for text in texts for w in _WORDS.findall(text.lower())}


class BlockText:
    """Synthetic text per block name: `block(name, n)` is n whole-word tokens, the same for
    the same name (a shorter block is a prefix of a longer one of that name)."""

    def __init__(self, synth: PromptSynth, seed: int = 0, avoid: set[str] = frozenset()) -> None:
        self.words = [w for w in synth.words if w.strip() not in avoid]
        if len(self.words) < 100:
            raise ValueError("too few vocabulary words left to write synthetic text")
        self.seed = seed

    def block(self, name: object, num_tokens: int) -> str:
        rng = random.Random(f"{self.seed}:{name}")
        return "".join(rng.choice(self.words) for _ in range(num_tokens))

    def prompt(self, names: list[object], num_tokens: int, block_size: int) -> str:
        """`num_tokens` tokens made of the named blocks in turn, the last one cut short."""
        parts, left = [], num_tokens
        for name in names:
            if left <= 0:
                break
            parts.append(self.block(name, min(block_size, left)))
            left -= block_size
        return "".join(parts)


def block_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """Chained hashes of the token blocks (the last one may be partial): equal prefixes of
    whole blocks give equal leading hashes, as in a prefix cache."""
    out, parent = [], ""
    for start in range(0, len(token_ids), block_size):
        chunk = ",".join(map(str, token_ids[start:start + block_size]))
        parent = hashlib.sha256(f"{parent}|{chunk}".encode()).hexdigest()[:16]
        out.append(parent)
    return out


def shared_prefix_lens(blocks: list[list[object]], lengths: list[int],
                       block_size: int) -> list[int]:
    """Per request: tokens of its leading blocks that an earlier request already had."""
    seen: set[object] = set()
    out = []
    for names, length in zip(blocks, lengths):
        shared = 0
        for name in names:
            if name not in seen:
                break
            shared += 1
        out.append(min(shared * block_size, length))
        seen.update(names)
    return out


def anonymize(trace: Trace, synth: PromptSynth, seed: int = 0,
              block_size: int = DEFAULT_BLOCK_SIZE) -> Trace:
    """The trace with every prompt replaced by synthetic blocks (see the module doc), ids,
    tenants and sessions renamed in order of appearance, and the source's name dropped."""
    texts = [r.prompt for r in trace.requests if r.prompt is not None]
    blocks = BlockText(synth, seed, avoid=words_of(texts))
    tenants: dict[str, str] = {}
    sessions: dict[str, str] = {}
    ids: dict[str, str] = {}
    requests = []
    for i, r in enumerate(trace.requests):
        new_id = f"{r.cls}-{i:05d}"
        if r.id is not None:
            ids[r.id] = new_id
        prompt, prompt_len = r.prompt, r.prompt_len
        if prompt is not None:
            token_ids = synth.tokenizer.encode(prompt, add_special_tokens=False).ids
            prompt = blocks.prompt(block_hashes(token_ids, block_size), len(token_ids),
                                   block_size)
            prompt_len = synth.count(prompt)
        requests.append(replace(
            r, prompt=prompt, prompt_len=prompt_len, id=new_id,
            tenant=_rename(tenants, r.tenant, "tenant"),
            session=_rename(sessions, r.session, "session"),
            after=ids.get(r.after) if r.after is not None else None))
    header = {k: v for k, v in trace.header.items() if k != "source"}
    header["anonymized"] = {"block_size": block_size,
                            "what": "synthetic tokens per prefix block; ids, tenants and "
                                    "sessions renamed"}
    if "source" in trace.header:
        header["source"] = {"format": trace.header["source"].get("format")}
    return Trace(requests, header)


def _rename(names: dict[str, str], name: str | None, kind: str) -> str | None:
    if name is None:
        return None
    return names.setdefault(name, f"{kind}-{len(names) + 1}")
