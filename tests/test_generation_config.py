"""The model's own sampling defaults (--generation-config, vLLM's `auto`): read from a Hugging
Face folder's generation_config.json or a GGUF's general.sampling.* keys (the bundled model:
its card's), given to every request that leaves temperature, top_p, top_k or
repetition_penalty unset, on each endpoint and in LLM.generate/chat; `none` turns them off."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from model_fixtures import smollm_loaded
from scripted_model import ScriptedRunner, scripted_client

from loom.config import ModelConfig
from loom.model.arch import default_model_path
from loom.model.generation_config import (
    BUNDLED_MODEL_DEFAULTS,
    LOOM_DEFAULTS,
    SamplingDefaults,
    from_generation_config,
    from_gguf_metadata,
    resolve,
)
from loom.model.gguf_file import read_gguf
from loom.model.model_files import tokenizer_from_gguf, tokenizer_from_hf_folder

GENERATION_CONFIG = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95,
                     "top_k": 20, "repetition_penalty": 1.05}


@pytest.mark.unit
def test_generation_config_json_and_gguf_keys_are_read() -> None:
    read = from_generation_config(GENERATION_CONFIG, "x")
    assert read == SamplingDefaults(0.6, 0.95, 20, 1.05, "x")
    assert from_generation_config({"bos_token_id": 1}, "x") is None  # nothing to apply
    assert from_generation_config({"top_k": 0}, "x").top_k == -1  # transformers' "off"
    gguf = from_gguf_metadata({"general.sampling.temp": 0.7, "general.sampling.top_k": 40,
                               "general.sampling.penalty_repeat": 1.1}, "y")
    assert (gguf.temperature, gguf.top_p, gguf.top_k, gguf.repetition_penalty) == \
        (0.7, 1.0, 40, 1.1)


@pytest.mark.unit
def test_values_sampling_would_refuse_are_left_out(caplog: pytest.LogCaptureFixture) -> None:
    read = from_generation_config({"temperature": -1, "top_p": 0.5}, "bad.json")
    assert read.temperature == LOOM_DEFAULTS.temperature and read.top_p == 0.5
    assert "ignoring temperature=-1" in caplog.text


@pytest.mark.unit
def test_the_choice_picks_whose_defaults(tmp_path: Path) -> None:
    own = SamplingDefaults(temperature=0.6)
    assert resolve("auto", "m.gguf", own) == own
    assert resolve("auto", "m.gguf", None) == LOOM_DEFAULTS
    assert resolve("auto", None, None) == BUNDLED_MODEL_DEFAULTS  # the bundled model
    assert resolve("none", "m.gguf", own) == LOOM_DEFAULTS
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert resolve(str(tmp_path), "m.gguf", own).temperature == 0.3
    with pytest.raises(ValueError, match="generation_config must be auto, none or an existing"):
        ModelConfig(generation_config=str(tmp_path / "missing"))


@pytest.mark.integration
def test_the_model_files_carry_their_defaults(tmp_path: Path) -> None:
    meta = dict(read_gguf(default_model_path()).metadata)
    assert tokenizer_from_gguf(meta).sampling_defaults is None  # the bundled GGUF sets none
    meta["general.sampling.temp"] = 0.8
    assert tokenizer_from_gguf(meta).sampling_defaults.temperature == 0.8
    (tmp_path / "tokenizer.json").write_text(smollm_loaded().tokenizer.backend.to_str())
    (tmp_path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    folder = tokenizer_from_hf_folder(tmp_path, {})
    assert folder.sampling_defaults == from_generation_config(
        GENERATION_CONFIG, str(tmp_path / "generation_config.json"))


def runner_with(defaults: SamplingDefaults | None) -> ScriptedRunner:
    tokenizer = dataclasses.replace(smollm_loaded().tokenizer, sampling_defaults=defaults)
    return ScriptedRunner(tokenizer, "Paris.")


QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.integration
def test_every_endpoint_samples_with_the_models_defaults() -> None:
    own = from_generation_config(GENERATION_CONFIG, "generation_config.json")
    runner = runner_with(own)
    model = ModelConfig(model=str(default_model_path()), max_model_len=4096)
    with scripted_client(runner, model) as client:
        client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4})
        client.post("/v1/completions", json={"prompt": "Paris is", "max_tokens": 4})
        response = client.post("/v1/responses", json={"input": "Capital?"}).json()
        client.post("/v1/chat/completions", json={  # what a request sets is kept
            "messages": QUESTION, "max_tokens": 4, "temperature": 0, "top_k": 0, "top_p": 0.5,
            "repetition_penalty": 1.0})
    got = [(p.temperature, p.top_p, p.top_k, p.repetition_penalty) for p in runner.params]
    assert got == [(0.6, 0.95, 20, 1.05)] * 3 + [(0.0, 0.5, -1, 1.0)]
    assert (response["temperature"], response["top_p"]) == (0.6, 0.95)  # echoed as run


@pytest.mark.integration
@pytest.mark.parametrize("choice,expected", [("auto", (0.2, 0.9)), ("none", (1.0, 1.0))])
def test_the_bundled_model_samples_as_its_card_says(choice: str, expected: tuple) -> None:
    runner = runner_with(None)
    with scripted_client(runner, ModelConfig(max_model_len=4096,
                                             generation_config=choice)) as client:
        client.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 4})
    assert (runner.params[0].temperature, runner.params[0].top_p) == expected


@pytest.mark.integration
def test_llm_generate_and_chat_default_to_the_models_sampling(llm) -> None:
    params = llm.default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k) == (0.2, 0.9, -1)
    assert params.max_tokens == 16
    out = llm.chat(QUESTION)[0].outputs[0]  # no SamplingParams: these, and 16 tokens at most
    assert 0 < len(out.token_ids) <= 16
