"""Configuration: one dataclass field per option, CLI flags generated from it."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from loom.cli.dataclass_flags import add_engine_args, engine_config
from loom.cli.main import build_parser
from loom.config import CacheConfig, EngineConfig, SchedulerConfig, parse_size


@pytest.mark.unit
def test_flags_round_trip_into_the_dataclasses() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--max-num-seqs", "7", "--no-enable-chunked-prefill",
                              "--scheduler", "static", "--kv-cache-memory", "1GiB",
                              "--max-num-batched-tokens", "4096"])
    config = engine_config(args)
    assert config.scheduler == SchedulerConfig(max_num_seqs=7, enable_chunked_prefill=False,
                                               scheduler="static", max_num_batched_tokens=4096)
    assert config.cache == CacheConfig(kv_cache_memory="1GiB")
    assert config.model.model is None  # untouched flags keep the dataclass defaults


@pytest.mark.unit
def test_every_field_has_exactly_one_flag() -> None:
    import dataclasses

    parser = build_parser(["generate"])
    help_text = parser._subparsers._group_actions[0].choices["generate"].format_help()
    for section in EngineConfig.SECTIONS:
        section_cls = type(getattr(EngineConfig(), section))
        for f in dataclasses.fields(section_cls):
            assert help_text.count("--" + f.name.replace("_", "-") + " ") + \
                help_text.count("--" + f.name.replace("_", "-") + ",") >= 1, f.name


@pytest.mark.unit
def test_bad_values_are_rejected_naming_the_option() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens must be >= 1"):
        SchedulerConfig(max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="cannot exceed max_num_batched_tokens"):
        SchedulerConfig(max_num_seqs=600, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="cannot parse size"):
        CacheConfig(kv_cache_memory="lots")
    with pytest.raises(TypeError, match="unknown engine option"):
        EngineConfig.from_kwargs(block_sise=16)
    # keywords no parser sees (LLM(...)) still take one of a Literal's values
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of 'auto', 'float16'"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig.from_kwargs(attention_backend="flash")
    assert EngineConfig.from_kwargs(kv_cache_dtype="float16").cache.kv_cache_dtype == "float16"
    parser = build_parser(["generate"])
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "hi", "--scheduler", "sometimes"])


@pytest.mark.unit
def test_parse_size_units() -> None:
    assert parse_size("4GiB") == 4 * 2**30
    assert parse_size("512MB") == 512 * 10**6
    assert parse_size(1234) == 1234


@pytest.mark.integration
def test_loom_generate_prints_the_completion() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loom.cli", "generate",
         "What is the capital of France?", "--chat", "--max-tokens", "16",
         "--kv-cache-memory", "64MiB"],
        capture_output=True, text=True, timeout=600)  # a model load on a busy machine
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


@pytest.mark.integration
def test_loom_generate_reports_a_bad_model_path_cleanly() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "loom.cli", "generate", "hi", "--model", "/nope.gguf"],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr
