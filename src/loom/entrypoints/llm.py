"""The offline API: `LLM(...).generate(prompts, params)`, shaped like vLLM's."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from loom.config import EngineConfig
from loom.engine.core import EngineCore
from loom.outputs import RequestOutput
from loom.sampling import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """Runs the engine in this process: submit all prompts, step until every one is done.

    Keyword arguments are engine options (see `loom.config`), e.g. `max_num_seqs=16`,
    `scheduler="static"`, `kv_cache_memory="1GiB"`.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self._start(EngineConfig.from_kwargs(model=model, **engine_options))

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 priority: Sequence[int] | None = None, use_tqdm: bool = False
                 ) -> list[RequestOutput]:
        """Outputs in the order of `prompts`. A prompt is a string or a list of token ids.
        Without `sampling_params`, each prompt samples with the model's own defaults
        (`generation_config`: temperature, top_p, top_k, repetition_penalty; loom's for what
        the model does not set) and SamplingParams' max_tokens (16)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        params = _per_prompt(sampling_params or self.default_sampling_params(), len(prompts),
                             "sampling_params")
        priorities = _per_prompt(list(priority) if priority is not None else 0, len(prompts),
                                 "priority")
        ids = [f"gen-{next(self._ids)}" for _ in prompts]
        try:
            for request_id, prompt, p, prio in zip(ids, prompts, params, priorities):
                self.engine.add_request(request_id, prompt, p, prio)
            return self._run(ids, use_tqdm)
        except BaseException:
            for request_id in ids:
                self.engine.abort_request(request_id)
            raise

    def default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` sample with when given no SamplingParams: the model's
        own defaults (vLLM's `get_default_sampling_params`)."""
        return self.engine.sampling_defaults.params()

    def chat(self, messages: list[Message] | Sequence[list[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them
        (`chat_template_kwargs`, e.g. {"enable_thinking": False}, are the template's
        variables); sampling as `generate`."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [self.tokenizer.encode(
            self.tokenizer.apply_chat_template(list(c), add_generation_prompt,
                                               template_kwargs=chat_template_kwargs),
            add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params)

    def get_metrics(self) -> dict[str, float]:
        return self.engine.metrics.snapshot()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        wanted = set(ids)
        progress = _progress(len(ids)) if use_tqdm else None
        in_flight = None  # with async scheduling, the step still running on the model
        while wanted - finished.keys() or in_flight is not None:
            outputs, in_flight = self.engine.step(in_flight)
            for output in outputs:
                if output.finished and output.request_id in wanted:
                    finished[output.request_id] = output
                    if progress:
                        progress.advance(progress.task_ids[0])
        if progress:
            progress.stop()
        return [finished[i] for i in ids]


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list | tuple):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def _progress(total: int) -> Any:
    from rich.progress import Progress

    progress = Progress(transient=True)
    progress.add_task("generating", total=total)
    progress.start()
    return progress
