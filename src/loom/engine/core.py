"""EngineCore: the step loop. Schedule, run the model, update, detokenize, report."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from loom import host
from loom.config import EngineConfig, parse_size
from loom.core.batch import ModelRunnerOutput, SchedulerOutput, TokenLogprob
from loom.core.kv_cache import KVCacheManager
from loom.core.scheduler import RequestUpdate, Scheduler
from loom.core.static import StaticScheduler
from loom.engine.detokenizer import IncrementalDetokenizer
from loom.engine.metrics import EngineMetrics
from loom.model.arch import ModelArch
from loom.model.kernels import block_quant_linear_ops, fused_ops, paged_attention_ops
from loom.model.linear import onednn_prepack_supported
from loom.model.llama import LlamaModel
from loom.model.loader import load_model
from loom.model.memory import KVCacheSpec
from loom.model.runner import ModelRunner
from loom.model.weights import BlockQuantWeight
from loom.outputs import CompletionOutput, RequestMetrics, RequestOutput
from loom.request import Request, RequestStatus
from loom.sampling import SamplingParams

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_SHARE, _CPU_KV_CAP = 0.25, 4 * 2**30
_GPU_KV_SHARE = 0.85


@dataclass
class _RequestState:
    """Engine-side state of a live request that the scheduler does not need."""

    request: Request
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob | None] | None
    stop_reason: str | int | None = None
    error: str | None = None
    last_token_time: float = 0.0
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        mc = config.model
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if mc.device == "auto" else mc.device)
        self.dtype = _DTYPES[mc.dtype] if mc.dtype != "auto" else (
            torch.bfloat16 if self.device.type == "cuda" or host.has_native_bf16()
            else torch.float32)
        if self.device.type == "cpu":
            torch.set_num_threads(mc.num_threads or host.usable_cpus())
        loaded = load_model(mc.model)
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        arch = loaded.arch
        self.max_model_len = _max_model_len(mc.max_model_len, arch)
        sc = config.scheduler
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens "
                f"({sc.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        prepack = self._use_onednn_linear(mc.linear_backend)
        block_quant = self._use_block_quant_linear(mc.linear_backend, loaded.block_quant)
        fused = (fused_ops() if self.device.type == "cpu" and self.dtype == torch.float32
                 else None)
        model = LlamaModel(arch, loaded.weights, self.dtype, self.device, prepack=prepack,
                           block_quant=loaded.block_quant if block_quant else None,
                           fused_ops=fused)
        del loaded
        num_blocks = self._num_kv_blocks(arch)
        block_size = config.cache.block_size
        self.kv_cache = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching)
        scheduler_cls = StaticScheduler if sc.scheduler == "static" else Scheduler
        self.scheduler: Scheduler = scheduler_cls(sc, self.kv_cache, self.max_model_len)
        self.runner = ModelRunner(model, num_blocks, block_size, self.dtype, self.device,
                                  native_decode=self._use_native_decode(mc.attention_backend, arch))
        logger.info("model %s on %s: dtype %s%s, decode attention %s, matmuls %s, add + norm "
                    "and SiLU * up %s, %d threads",
                    self.model_name, self.device, str(self.dtype).removeprefix("torch."),
                    " (auto)" if mc.dtype == "auto" else "",
                    "native kernel" if self.runner.native_decode else "torch",
                    "native on the GGUF's blocks" if block_quant
                    else "oneDNN prepacked" if prepack else "torch",
                    "fused kernels" if fused is not None else "torch", torch.get_num_threads())
        self.metrics = EngineMetrics(self.model_name)
        self.states: dict[str, _RequestState] = {}
        # Async scheduling: one worker thread runs the model; at most one step is in flight.
        self._executor = (ThreadPoolExecutor(1, thread_name_prefix="loom-model")
                          if sc.async_scheduling else None)
        self._in_flight: tuple[SchedulerOutput, Future] | None = None
        self._back_to_back = False
        self._last_forward_end: float | None = None

    # -- set-up ------------------------------------------------------------------------------

    def _use_native_decode(self, backend: str, arch: ModelArch) -> bool:
        if backend == "torch" or (backend == "auto" and self.device.type != "cpu"):
            return False
        ops = paged_attention_ops() if self.device.type == "cpu" else None
        shape = (arch.num_heads, arch.num_kv_heads, arch.head_dim,
                 self.config.cache.block_size, self.dtype)
        if ops is not None and ops.supported(*shape):
            return True
        if backend == "native":
            raise ValueError(
                "attention_backend 'native' is unavailable: it needs a CPU device, a C++ "
                "compiler (see any warning above), block_size 16, head_dim 64 or 128, 1-8 "
                "query heads per kv head and float32/bfloat16; use 'torch' or 'auto'")
        return False

    def _use_onednn_linear(self, backend: str) -> bool:
        if backend == "torch":
            return False
        if onednn_prepack_supported(self.device, self.dtype):
            return True
        if backend in ("onednn", "native"):
            raise ValueError(f"linear_backend {backend!r} needs a CPU device, float32 and a "
                             "torch built with oneDNN (mkldnn); use 'torch' or 'auto'")
        return False

    def _use_block_quant_linear(self, backend: str,
                                block_quant: dict[str, BlockQuantWeight]) -> bool:
        if backend not in ("auto", "native") or not onednn_prepack_supported(self.device,
                                                                             self.dtype):
            return False
        ops = block_quant_linear_ops()
        if block_quant and ops is not None and ops.supported():
            return True
        if backend == "native":
            raise ValueError(
                "linear_backend 'native' needs a GGUF model with Q4_0, Q4_1 or Q8_0 weights, "
                "a C++ compiler (see any warning above) and a CPU with AVX2 and FMA; use "
                "'onednn' or 'auto'")
        return False

    def _num_kv_blocks(self, arch: ModelArch) -> int:
        cc = self.config.cache
        bytes_per_block = KVCacheSpec.for_model(arch, self.dtype.itemsize).bytes_per_block(
            cc.block_size)
        if cc.num_kv_blocks is not None:
            num_blocks, source = cc.num_kv_blocks, "num_kv_blocks"
        else:
            if cc.kv_cache_memory is not None:
                budget, source = parse_size(cc.kv_cache_memory), "kv_cache_memory"
            elif self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * _GPU_KV_SHARE)
                source = f"{_GPU_KV_SHARE:.0%} of free GPU memory"
            else:
                budget = min(int(host.available_ram_bytes() * _CPU_KV_SHARE), _CPU_KV_CAP)
                source = f"{_CPU_KV_SHARE:.0%} of available RAM, at most 4 GiB"
            num_blocks = budget // bytes_per_block
            if num_blocks < 1:
                raise ValueError(f"KV cache budget {budget} bytes is less than one block "
                                 f"({bytes_per_block} bytes)")
        num_tokens = num_blocks * cc.block_size
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, from %s); "
            "max concurrency at max_model_len=%d: %.2fx",
            num_blocks, cc.block_size, num_tokens, num_blocks * bytes_per_block / 2**30, source,
            self.max_model_len, num_tokens / self.max_model_len)
        return num_blocks

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
                    priority: int = 0) -> None:
        """Tokenize and queue a request. Raises ValueError naming the problem if it can never
        run; nothing else is affected."""
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty")
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < max(vocab, self.runner.model.arch.vocab_size) for t in token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        request = Request(request_id, token_ids, params, eos_token_id=self.tokenizer.eos_token_id,
                          priority=priority)
        self.scheduler.add_request(request)
        self.states[request_id] = _RequestState(
            request=request, prompt=text,
            detokenizer=IncrementalDetokenizer(self.tokenizer, token_ids, params.stop),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        if self.scheduler.abort_request(request_id) is None:
            return None
        return self._finish_output(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step --------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One iteration: returns an output for every request that progressed or finished.

        With async scheduling, this schedules step N+1 while step N runs, launches N+1 as soon
        as N ends, and then processes N's tokens (so the outputs lag one step behind)."""
        batch = self.scheduler.schedule()
        self._note_scheduled(batch, time.monotonic())
        if self._executor is None:
            if batch.is_empty:
                self.update_gauges()
                return []
            return self._finish_step(batch, self._execute(batch))
        previous, self._in_flight = self._in_flight, None
        previous_output = None
        if previous is not None:
            previous_output = self._execute(*previous)
            batch.fill_placeholders(previous_output)
        if not batch.is_empty:
            self._in_flight = (batch, self._executor.submit(self._timed_forward, batch))
        if previous is None:
            self.update_gauges()
            return []
        return self._finish_step(previous[0], previous_output)

    def _finish_step(self, batch: SchedulerOutput, runner_output: ModelRunnerOutput
                     ) -> list[RequestOutput]:
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

    def _execute(self, batch: SchedulerOutput, running: Future | None = None
                 ) -> ModelRunnerOutput:
        """Run the batch (or collect it, if already `running`); if it throws, rerun each
        request alone so only the culprit fails."""
        try:
            return running.result() if running is not None else self._timed_forward(batch)
        except Exception:
            logger.exception("model step failed; retrying its %d requests one by one",
                             len(batch.scheduled))
        self._last_forward_end = None
        merged = ModelRunnerOutput()
        for item in batch.scheduled:
            request = self.scheduler.requests.get(item.request_id)
            if item.padding or request is None or request.status != RequestStatus.RUNNING:
                continue  # finished, or sent back to the queue by a failure before it
            try:
                single = self.runner.execute(SchedulerOutput(scheduled=[item]))
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
            if state is not None and state.prompt_logprobs is not None:
                known = len(state.prompt_logprobs)  # recomputation after preemption repeats some
                state.prompt_logprobs.extend(entries[known - start:])
        outputs = []
        for update in updates:
            request, state = update.request, self.states[update.request.request_id]
            self.metrics.generation_tokens.inc()
            m = state.metrics
            if m.first_token_time is None:
                m.first_token_time = now
                self.metrics.ttft.observe(now - m.arrival_time)
                self.metrics.prefill_time.observe(now - (m.first_scheduled_time or now))
            else:
                self.metrics.itl.observe(now - state.last_token_time)
            state.last_token_time = now
            if state.logprobs is not None:
                state.logprobs.append(runner_output.logprobs[request.request_id])
            state.detokenizer.push(update.new_token_id)
            if update.finished:
                if request.status == RequestStatus.FINISHED_STOPPED:
                    state.stop_reason = (update.new_token_id
                                         if update.new_token_id != request.eos_token_id else None)
            elif state.detokenizer.stopped_on is not None:
                state.stop_reason = state.detokenizer.stopped_on
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            outputs.append(self._output(request.request_id))
        for item in batch.scheduled:  # requests whose step failed (already ended in _execute)
            state = self.states.get(item.request_id)
            if state is not None and state.error is not None:
                outputs.append(self._finish_output(item.request_id))
        return outputs

    def _output(self, request_id: str) -> RequestOutput:
        state = self.states[request_id]
        if state.request.status.finished:
            return self._finish_output(request_id)
        return self._build_output(state, finished=False)

    def _finish_output(self, request_id: str) -> RequestOutput:
        state = self.states.pop(request_id)
        request, m = state.request, state.metrics
        m.finished_time = time.monotonic()
        m.num_preemptions = request.num_preemptions
        reason = request.status.value
        self.metrics.finished(reason)
        self.metrics.e2e.observe(m.finished_time - m.arrival_time)
        if m.first_token_time is not None:
            self.metrics.decode_time.observe(m.finished_time - m.first_token_time)
        return self._build_output(state, finished=True)

    def _build_output(self, state: _RequestState, finished: bool) -> RequestOutput:
        request = state.request
        completion = CompletionOutput(
            index=0,
            text=state.detokenizer.visible_text(finished),
            token_ids=list(request.output_token_ids),
            finish_reason=request.status.value if finished else None,
            stop_reason=state.stop_reason,
            logprobs=state.logprobs,
        )
        return RequestOutput(
            request_id=request.request_id, prompt=state.prompt,
            prompt_token_ids=request.prompt_token_ids, outputs=[completion], finished=finished,
            prompt_logprobs=state.prompt_logprobs, num_cached_tokens=request.num_cached_tokens,
            error=state.error, metrics=state.metrics)

    def update_gauges(self) -> None:
        """Refresh the running / waiting / KV gauges; also called without a step, when
        aborts leave the engine idle and no further step would show their blocks freed."""
        self.metrics.running.set(self.scheduler.num_running)
        self.metrics.waiting.set(self.scheduler.num_waiting)
        self.metrics.kv_usage.set(self.kv_cache.pool.usage)
        self.metrics.maybe_log_stats(busy=self.has_unfinished_requests())


def _max_model_len(requested: int | None, arch: ModelArch) -> int:
    if requested is None:
        return arch.max_position_embeddings
    if requested > arch.max_position_embeddings:
        raise ValueError(f"max_model_len {requested} exceeds the model's context length "
                         f"{arch.max_position_embeddings}")
    return requested
