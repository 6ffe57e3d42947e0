"""A stand-in model that answers every request with one scripted text, behind the engine's
runner protocol: the real engine loop, detokenizer and HTTP server around it, with any
tokenizer and chat template, so the server's handling of a thinking model's or a tool-calling
model's answer can be checked without the model."""

from __future__ import annotations

from fastapi.testclient import TestClient

from loom.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from loom.core.batch import ModelRunnerOutput, SchedulerOutput
from loom.engine.async_engine import AsyncEngine
from loom.engine.core import EngineCore
from loom.entrypoints.openai.launch import ServerConfig
from loom.model.arch import ModelInfo
from loom.model.tokenizer import Tokenizer
from loom.sampling import SamplingParams


class ScriptedRunner:
    """Samples the tokens of `answer` one by one, then the tokenizer's EOS; records the
    prompt of every request it saw (decoded), to check what the chat template rendered."""

    def __init__(self, tokenizer: Tokenizer, answer: str) -> None:
        self.info = ModelInfo("scripted", tokenizer, tokenizer.vocab_size, 4096)
        self.tokenizer = tokenizer
        self.answer = answer
        self.prompts: list[str] = []
        self.params: list[SamplingParams] = []  # of every request, as the engine ran it

    def determine_num_kv_blocks(self, cache: CacheConfig, max_model_len: int,
                                scheduler: SchedulerConfig) -> int:
        return cache.num_kv_blocks or 256

    def initialize_kv_cache(self, num_blocks: int) -> None:
        return None  # no sliding-window KV group

    def execute(self, batch: SchedulerOutput) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        script = [*self.tokenizer.encode(self.answer, add_special_tokens=False),
                  self.tokenizer.eos_token_ids[0]]
        for item in batch.scheduled:
            if not item.sample:
                continue
            generated = item.start_position + len(item.token_ids) - item.num_prompt_tokens
            if generated == 0:
                self.prompts.append(self.tokenizer.decode(item.prompt_token_ids,
                                                          skip_special_tokens=False))
                self.params.append(item.sampling_params)
            out.sampled_token_ids[item.request_id] = script[min(generated, len(script) - 1)]
        return out


def scripted_client(runner: ScriptedRunner, model: ModelConfig | None = None,
                    **server_options: object) -> TestClient:
    """The HTTP app over the real engine loop on `runner` (started by the client's context);
    `model`: the engine's model options (--generation-config)."""
    from loom.entrypoints.openai.server import build_app

    core = EngineCore(EngineConfig(model=model or ModelConfig(max_model_len=4096),
                                   cache=CacheConfig(num_kv_blocks=256)), runner=runner)
    return TestClient(build_app(AsyncEngine(core), ServerConfig(**server_options)),
                      base_url="http://127.0.0.1")
