"""EngineCore: the step loop. Schedule, run the model, update, detokenize, report.

The engine takes a runner (anything with `Runner`'s calls: the real `ModelRunner`, or a
stand-in in tests and the simulator), asks it how many KV blocks fit, and from then on only
moves plain data between the scheduler and the runner.

One step is `step(previous) -> (outputs, in_flight)`. Without async scheduling a step runs to
completion inside the call and nothing is left in flight. With it, the call schedules step N+1,
waits for step N (`previous`), launches N+1 on the model thread and only then processes N's
tokens, returning N+1 as the value to pass to the next call. The loop that owns the engine
holds that value; the engine keeps no hidden pipeline state.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from loom.config import CacheConfig, EngineConfig, SchedulerConfig
from loom.core.batch import GrammarBitmask, ModelRunnerOutput, SchedulerOutput, SlidingKVGroup
from loom.core.kv_cache import KVCacheManager
from loom.core.scheduler import RequestUpdate, Scheduler
from loom.core.static import StaticScheduler
from loom.engine.metrics import EngineMetrics
from loom.engine.request_state import RequestState
from loom.engine.spec_metrics import SpecDecodeMetrics
from loom.model.arch import ModelInfo
from loom.outputs import RequestOutput
from loom.request import Request, RequestStatus
from loom.sampling import SamplingParams
from loom.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)

_COMPILE_WAIT_S = 0.05  # an idle engine waiting for a grammar still looks at its inbox this often


class Runner(Protocol):
    """What the engine needs of a model runner (see loom.model.runner.ModelRunner)."""

    info: ModelInfo

    def determine_num_kv_blocks(self, cache: CacheConfig, max_model_len: int,
                                scheduler: SchedulerConfig) -> int: ...

    def initialize_kv_cache(self, num_blocks: int) -> SlidingKVGroup | None: ...

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass
class InFlightStep:
    """A step handed to the model and not yet processed: its batch and, once launched on the
    model thread, the future of its output."""

    batch: SchedulerOutput
    future: Future[ModelRunnerOutput]


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner | None = None) -> None:
        if runner is None:
            from loom.model.runner import ModelRunner  # the real model: torch and the weights

            runner = ModelRunner.from_config(config)
        self.config = config
        self.runner = runner
        info = runner.info
        self.model_name = info.name
        self.tokenizer = info.tokenizer
        from loom.model.generation_config import resolve  # torch-free, but model/'s

        self.sampling_defaults = resolve(config.model.generation_config, config.model.model,
                                         self.tokenizer.sampling_defaults)
        self.max_model_len = _max_model_len(config.model.max_model_len,
                                            info.max_position_embeddings)
        sc = config.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens "
                f"({sc.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        num_blocks = runner.determine_num_kv_blocks(config.cache, self.max_model_len, sc)
        sliding = runner.initialize_kv_cache(num_blocks)  # the sliding layers' own KV, if any
        self.kv_cache = KVCacheManager(num_blocks, config.cache.block_size,
                                       config.cache.enable_prefix_caching, sliding)
        scheduler_cls = StaticScheduler if sc.scheduler == "static" else Scheduler
        self.scheduler: Scheduler = scheduler_cls(sc, self.kv_cache, self.max_model_len)
        self.metrics = EngineMetrics(self.model_name)
        spec = sc.speculative
        self.spec_metrics = (SpecDecodeMetrics(self.metrics.registry, self.model_name,
                                               spec.num_speculative_tokens) if spec else None)
        self.states: dict[str, RequestState] = {}
        self.vocab_size = max(self.tokenizer.vocab_size, info.vocab_size)
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size)
        self._compiling: dict[str, Request] = {}  # constrained requests not yet schedulable
        # Async scheduling: one worker thread runs the model; at most one step is in flight.
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="loom-model")
                          if sc.async_scheduling else None)
        self._back_to_back = False
        self._last_forward_end: float | None = None

    # -- what the async engine and the server read (the loop thread owns the rest) ----------

    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.pool.num_blocks

    @property
    def block_size(self) -> int:
        return self.kv_cache.block_size

    def is_unscheduled(self, request_id: str) -> bool:
        """True while the request is queued and no step has run any of it yet."""
        state = self.states.get(request_id)
        return state is not None and state.metrics.first_scheduled_time is None

    # -- requests --------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Tokenize and queue a request that arrived at `arrival_time` (time.monotonic();
        default now). Raises ValueError naming the problem if it can never run; nothing else
        is affected."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        params.check_vocab(vocab)
        spec = params.structured_outputs  # checked here (a ValueError naming the problem),
        grammar = self.structured.start(request_id, spec) if spec else None  # compiled later
        request = Request(request_id, token_ids, params,
                          eos_token_ids=frozenset(self.tokenizer.eos_token_ids),
                          priority=priority, grammar=grammar)
        self.scheduler.add_request(request)
        if grammar is not None:
            self._compiling[request_id] = request
        self.states[request_id] = RequestState.new(
            request, text, self.tokenizer,
            time.monotonic() if arrival_time is None else arrival_time)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if self.scheduler.abort_request(request_id) is None:
            return None
        return self._finish_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (blocks in use stay with their requests): benchmark
        repeats then start cold, as vLLM's /reset_prefix_cache lets them."""
        self.scheduler.kv_cache.reset_prefix_cache()

    # -- the step --------------------------------------------------------------------------------

    def step(self, previous: InFlightStep | None = None
             ) -> tuple[list[RequestOutput], InFlightStep | None]:
        """One iteration: (an output for every request that progressed or finished, the step
        left in flight). Pass the returned step back in on the next call."""
        failed = self._end_failed_compiles()
        batch = self.scheduler.schedule()
        self._attach_grammar_bitmask(batch)
        self._note_scheduled(batch, time.monotonic())
        if self._executor is None:  # plain loop: this step runs and is processed now
            if batch.is_empty:
                self._idle()
                return failed, None
            return failed + self._finish_step(batch, self._collect(self._launch(batch))), None
        previous_output = None
        if previous is not None:  # overlapped loop: N+1 needs N's sampled tokens first
            previous_output = self._collect(previous)
            batch.fill_placeholders(previous_output)
        in_flight = self._launch(batch) if not batch.is_empty else None
        if previous is None:
            if in_flight is None:
                self._idle()
            else:
                self.update_gauges()
            return failed, in_flight
        return failed + self._finish_step(previous.batch, previous_output), in_flight

    def _idle(self) -> None:
        """Nothing to run: only requests whose grammar is compiling, or none. Wait a little
        for a compile rather than spin."""
        if self._compiling:
            self.structured.wait_for_compiles(_COMPILE_WAIT_S)
        self.update_gauges()

    def _end_failed_compiles(self) -> list[RequestOutput]:
        """Forget requests whose grammar is compiled; end those whose grammar failed to."""
        outputs = []
        for request_id, request in list(self._compiling.items()):
            if request.status.finished or request.grammar.ready:
                del self._compiling[request_id]
                if not request.status.finished and request.grammar.error is not None:
                    self.states[request_id].error = request.grammar.error
                    self.scheduler.fail_request(request_id)
                    outputs.append(self._finish_output(request_id))
        return outputs

    def _attach_grammar_bitmask(self, batch: SchedulerOutput) -> None:
        """The allowed tokens of every constrained request that samples in this step. Its
        matcher is up to date: such a request is never scheduled while a token of its is
        being sampled."""
        constrained = [(item, request.grammar) for item in batch.scheduled
                       if item.sample and not item.padding
                       and (request := self.scheduler.requests.get(item.request_id)) is not None
                       and request.grammar is not None]
        if constrained:
            batch.grammar_bitmask = GrammarBitmask(
                [item.request_id for item, _ in constrained
                 for _ in range(item.num_draft_tokens + 1)],
                self.structured.fill_bitmask(
                    [(grammar, item.token_ids[len(item.token_ids) - item.num_draft_tokens:])
                     for item, grammar in constrained]))

    def _launch(self, batch: SchedulerOutput) -> InFlightStep:
        """Hand the batch to the model: on the model thread with async scheduling, else run it
        here and return it already done."""
        if self._executor is not None:
            return InFlightStep(batch, self._executor.submit(self._timed_forward, batch))
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self._timed_forward(batch))
        except Exception as e:  # noqa: BLE001 - _collect retries the batch request by request
            future.set_exception(e)
        return InFlightStep(batch, future)

    def _finish_step(self, batch: SchedulerOutput, runner_output: ModelRunnerOutput
                     ) -> list[RequestOutput]:
        if self.spec_metrics is not None:
            self.spec_metrics.observe(batch, runner_output)
        updates = self.scheduler.update(batch, runner_output)
        outputs = self._process(batch, runner_output, updates)
        self.metrics.iteration_tokens.observe(batch.num_scheduled_tokens)
        self.update_gauges()
        # The loop goes straight on to the next step only while work is left; only then is
        # the time until the next forward pass overhead rather than waiting for requests.
        self._back_to_back = self.has_unfinished_requests()
        return outputs

    def _timed_forward(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        start = time.monotonic()
        if self._back_to_back and self._last_forward_end is not None:
            self.metrics.idle_gap.observe(max(0.0, start - self._last_forward_end))
        output = self.runner.execute(batch)
        self._last_forward_end = time.monotonic()
        self.metrics.forward_time.observe(self._last_forward_end - start)
        return output

    def _collect(self, step: InFlightStep) -> ModelRunnerOutput:
        """The step's output; if it threw, rerun each request alone so only the culprit fails."""
        try:
            return step.future.result()
        except Exception:
            logger.exception("model step failed; retrying its %d requests one by one",
                             len(step.batch.scheduled))
        self._last_forward_end = None
        merged = ModelRunnerOutput()
        for item in step.batch.scheduled:
            request = self.scheduler.requests.get(item.request_id)
            if item.padding or request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, or sent back to the queue by a failure before it
            try:
                single = self.runner.execute(SchedulerOutput(
                    scheduled=[item], grammar_bitmask=step.batch.grammar_bitmask))
            except Exception as e:  # noqa: BLE001 - any failure ends this request only
                logger.exception("request %s failed", item.request_id)
                self.states[item.request_id].error = f"{type(e).__name__}: {e}"
                self.scheduler.fail_request(item.request_id)
                continue
            merged.sampled_token_ids.update(single.sampled_token_ids)
            merged.logprobs.update(single.logprobs)
            merged.prompt_logprobs.update(single.prompt_logprobs)
        return merged

    def _note_scheduled(self, batch: SchedulerOutput, now: float) -> None:
        self.metrics.preemptions.inc(len(batch.preempted_request_ids))
        for item in batch.scheduled:
            if item.padding:
                continue
            state = self.states[item.request_id]
            if state.metrics.first_scheduled_time is None:
                state.metrics.first_scheduled_time = now
                self.metrics.queue_time.observe(now - state.metrics.arrival_time)
                request = state.request
                self.metrics.prefix_queries.inc(request.num_prompt_tokens)
                self.metrics.prefix_hits.inc(request.num_cached_tokens)
            if item.start_position < item.num_prompt_tokens:
                self.metrics.prompt_tokens.inc(
                    min(item.start_position + len(item.token_ids), item.num_prompt_tokens)
                    - item.start_position)

    def _process(self, batch: SchedulerOutput, runner_output: ModelRunnerOutput,
                 updates: list[RequestUpdate]) -> list[RequestOutput]:
        now = time.monotonic()
        for request_id, (start, entries) in runner_output.prompt_logprobs.items():
            state = self.states.get(request_id)
            if state is not None:
                state.add_prompt_logprobs(start, entries)
        outputs = []
        for update in updates:
            request, state = update.request, self.states[update.request.request_id]
            if request.status == RequestStatus.FINISHED_ERROR:  # a token its grammar refused
                state.error = request.grammar.error
            if state.logprobs is not None:  # such requests get no drafts: one token a step
                state.logprobs.append(runner_output.logprobs[request.request_id])
            new_token_ids = update.new_token_ids
            kept = len(new_token_ids)
            for i, token_id in enumerate(new_token_ids):
                state.detokenizer.push(token_id)
                if state.detokenizer.stopped_on is not None:
                    kept = i + 1
                    self.scheduler.stop_on_string(request, state.detokenizer.stopped_on,
                                                  len(new_token_ids) - kept)
                    break
            state.note_tokens(self.metrics, now, kept)
            outputs.append(self._output(request.request_id))
        for item in batch.scheduled:  # requests whose step failed (already ended in _collect)
            state = self.states.get(item.request_id)
            if state is not None and state.error is not None:
                outputs.append(self._finish_output(item.request_id))
        return outputs

    def _output(self, request_id: str) -> RequestOutput:
        state = self.states[request_id]
        if state.request.status.finished:
            return self._finish_output(request_id)
        return state.output(finished=False)

    def _finish_output(self, request_id: str) -> RequestOutput:
        state = self.states.pop(request_id)
        state.note_finished(self.metrics)
        return state.output(finished=True)

    def update_gauges(self) -> None:
        """Refresh the running / waiting / KV gauges; also called without a step, when
        aborts leave the engine idle and no further step would show their blocks freed."""
        self.metrics.running.set(self.scheduler.num_running)
        self.metrics.waiting.set(self.scheduler.num_waiting)
        self.metrics.kv_usage.set(self.kv_cache.pool.usage)
        self.metrics.maybe_log_stats(busy=self.has_unfinished_requests())


def _max_model_len(requested: int | None, model_context: int) -> int:
    if requested is None:
        return model_context
    if requested > model_context:
        raise ValueError(f"max_model_len {requested} exceeds the model's context length "
                         f"{model_context}")
    return requested
