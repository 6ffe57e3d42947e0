"""The engine's side of structured outputs: compile grammars against the model's tokenizer off
the step loop, and fill each step's token bitmask.

A request with a constraint is queued at once with a GrammarState whose compile runs on a pool
of worker threads; the scheduler admits it only once that is done, so a slow grammar holds up
its own request, never the step loop nor the compiles of other requests (the pool has
`compile_workers()` threads, and a spec already compiling is compiled once for every request
that asks). Compiled matchers are cached by (kind, spec): a request whose spec is cached gets
its copy at once, on the loop thread, without the pool. The llguidance tokenizer (the
vocabulary as llguidance walks it) is built once, on a worker, by the first constrained
request.

The compile is native code that recurses on the grammar's nesting, so the workers run with
COMPILE_STACK_BYTES of stack: more than the server's check (checker.CHECK_STACK_BYTES) gives
the same compile, so a spec the server let through cannot overflow it here.
"""

from __future__ import annotations

import queue
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import Any

from loom.host import usable_cpus
from loom.sampling import StructuredOutputsParams
from loom.structured.grammar import check_writable, client_reason, grammar_for
from loom.structured.state import GrammarState

_CACHE_SIZE = 256
COMPILE_STACK_BYTES = 64 * 2**20  # address space; only the pages a compile touches are used


def compile_workers() -> int:
    """Compile threads: one per usable core, at least 2 (so one slow grammar never holds up
    every other), at most 8."""
    return max(2, min(8, usable_cpus()))


class _CompilePool:
    """Worker threads with a large stack, taking jobs in arrival order."""

    def __init__(self, size: int) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]]] = (
            queue.SimpleQueue())
        old = threading.stack_size(COMPILE_STACK_BYTES)
        try:
            for i in range(size):
                threading.Thread(target=self._work, name=f"loom-grammar-{i}",
                                 daemon=True).start()
        finally:
            threading.stack_size(old)

    def submit(self, job: Callable[[], Any]) -> Future[Any]:
        future: Future[Any] = Future()
        self._jobs.put((job, future))
        return future

    def _work(self) -> None:
        while True:
            job, future = self._jobs.get()
            try:
                future.set_result(job())
            except Exception as e:  # noqa: BLE001 - the request that asked fails, with why
                future.set_exception(e)


class StructuredOutputManager:
    """`tokenizer` is loom's Tokenizer (its `backend` is a `tokenizers` Tokenizer);
    `vocab_size` is the width of the model's logits, which the bitmask covers."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._pool: _CompilePool | None = None
        self._ll_tokenizer: Any = None
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()  # the cache: compiles finish on the workers
        self._compiling: dict[tuple[str, str], Future[Any]] = {}  # loop thread only
        self._pending: set[Future[Any]] = set()

    def start(self, request_id: str, params: StructuredOutputsParams) -> GrammarState:
        """A choice the vocabulary cannot write raises StructuredOutputsError now; the rest
        is checked and compiled on the pool, and a spec that fails there fails its request
        with the reason."""
        check_writable(params, self._tokenizer)
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
        mine: Future[Any] = Future()
        if compiled is not None:  # a cache hit: no pool, no wait
            mine.set_result(compiled.deep_copy())
            return GrammarState(request_id, mine)
        shared = self._compiling.get(key)
        if shared is None:
            if self._pool is None:
                self._pool = _CompilePool(compile_workers())
            shared = self._pool.submit(lambda: self._compile(params))
            self._compiling[key] = shared
            self._pending.add(shared)
            shared.add_done_callback(self._pending.discard)
        shared.add_done_callback(lambda done: self._copy_to(done, mine, key))
        return GrammarState(request_id, mine)

    def _copy_to(self, compiled: Future[Any], mine: Future[Any], key: tuple[str, str]) -> None:
        """A finished compile, as one request's own matcher (or its failure)."""
        self._compiling.pop(key, None)
        if compiled.exception() is not None:
            mine.set_exception(compiled.exception())
        else:
            mine.set_result(compiled.result().deep_copy())

    def wait_for_compiles(self, timeout: float) -> None:
        """Block until a compile in progress ends (or `timeout`): what an engine with nothing
        else to run does instead of spinning."""
        pending = list(self._pending)
        if pending:
            wait(pending, timeout, return_when=FIRST_COMPLETED)

    def _compile(self, params: StructuredOutputsParams) -> Any:
        import llguidance

        grammar = grammar_for(params)  # raises StructuredOutputsError naming the problem
        compiled = llguidance.LLMatcher(self._llguidance_tokenizer(), grammar, log_level=0)
        if compiled.is_error():
            raise ValueError(client_reason(compiled.get_error()))
        with self._lock:
            self._cache[params.key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _llguidance_tokenizer(self) -> Any:
        with self._tokenizer_lock:  # workers compile at once: build it once
            if self._ll_tokenizer is None:
                import llguidance

                tok = self._tokenizer
                self._ll_tokenizer = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_Vocabulary(tok, self.vocab_size)),
                    n_vocab=self.vocab_size, eos_token=list(tok.eos_token_ids) or None)
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


class _Vocabulary:
    """The model's vocabulary as llguidance's TokenizerWrapper takes it: each token's own
    bytes, only the control tokens special. llguidance's reader of a tokenizer.json makes
    every added token special, and its tokenizer still makes them of their text: a grammar
    writing `<think>` or `<tool_call>` (Qwen3's added, non-special tokens) had the token
    forced, then refused ("the constraint needs text this model's vocabulary cannot
    write"). Text is tokenized with special-token text as plain text (a control token is no
    text a grammar writes); it comes as str only (bytes raise, so the wrapper passes str and
    llguidance tokenizes what is not whole UTF-8 itself)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        added = tokenizer.backend.get_added_tokens_decoder()
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = sorted(i for i, token in added.items() if token.special)
        eos = list(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else None
        self.bos_token_id = tokenizer.bos_token_id
        self._encode = tokenizer.encode_plain

    def __call__(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError("text, not bytes")
        return self._encode(text)
