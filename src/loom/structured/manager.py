"""The engine's side of structured outputs: compile grammars against the model's tokenizer on
a worker thread, and fill each step's token bitmask.

A request with a constraint is queued at once with a GrammarState whose compile runs on the
worker; the scheduler admits it only once that is done, so a slow grammar holds up its own
request, never the step loop. Compiled matchers are cached by (kind, spec): a request gets a
copy of the cached one. The llguidance tokenizer (the vocabulary as llguidance walks it) is
built once, on the worker, by the first constrained request.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any

from loom.sampling import StructuredOutputsParams
from loom.structured.grammar import check_writable, grammar_for
from loom.structured.state import GrammarState

_CACHE_SIZE = 256


class StructuredOutputManager:
    """`tokenizer` is loom's Tokenizer (its `backend` is a `tokenizers` Tokenizer);
    `vocab_size` is the width of the model's logits, which the bitmask covers."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._executor: ThreadPoolExecutor | None = None
        self._ll_tokenizer: Any = None
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache: compiles run on the worker
        self._pending: set[Future[Any]] = set()

    def start(self, request_id: str, params: StructuredOutputsParams) -> GrammarState:
        """Check the constraint now (raises StructuredOutputsError naming the problem) and
        compile it on the worker."""
        grammar = grammar_for(params)
        check_writable(params, self._tokenizer)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="loom-grammar")
        future = self._executor.submit(self._matcher, params.key, grammar)
        self._pending.add(future)
        future.add_done_callback(self._pending.discard)
        return GrammarState(request_id, future)

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a compile in progress ends (or `timeout`): what an engine with nothing
        else to run does instead of spinning."""
        pending = list(self._pending)
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def _matcher(self, key: tuple[str, str], grammar: str) -> Any:
        import llguidance

        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled.deep_copy()
        compiled = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(compiled.get_error())
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled.deep_copy()

    def _llguidance_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance

            tok = self._tokenizer
            self._ll_tokenizer = llguidance.LLTokenizer(
                tok.backend.to_str(), n_vocab=self.vocab_size,
                eos_token=list(tok.eos_token_ids) or None)
        return self._ll_tokenizer

    def fill_bitmask(self, entries: list[tuple[GrammarState, list[int]]]) -> Any:
        """The allowed tokens at each position a request samples at this step: for a state
        and its draft tokens (none without speculative decoding), one row for its next
        position and one after each draft, the matcher walked along the drafts and back. An
        int32 array [rows, ceil(vocab / 32)], bit j of word i allowing token 32 i + j (the
        layout llguidance and xgrammar share)."""
        import llguidance.numpy as lln

        num_rows = sum(len(drafts) + 1 for _, drafts in entries)
        bitmask = lln.allocate_token_bitmask(num_rows, self.vocab_size)
        row = 0
        for state, drafts in entries:
            lln.fill_next_token_bitmask(state.matcher, bitmask, row)
            row += 1
            for token_id in drafts:  # the scheduler kept only drafts the grammar allows
                state.matcher.consume_token(token_id)
                lln.fill_next_token_bitmask(state.matcher, bitmask, row)
                row += 1
            if drafts:
                state.matcher.rollback(len(drafts))
        return bitmask
