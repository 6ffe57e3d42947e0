"""Engine configuration: frozen dataclasses, validated once, from which CLI flags are generated.

Every option is spelled exactly once, as a dataclass field with its help (`flag_help`) and
flag name (`flag_name`); the command line's flag generator (`loom.cli.dataclass_flags`) turns
the fields into flags and back, `from_kwargs` turns keyword arguments (`LLM(...)`) into the
dataclass.
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

T = TypeVar("T")

_SIZE_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9,
               "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """'4GiB', '512MB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 4GiB, 512MiB or a byte count")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def flag_help(text: str, group: str | None = None, flag: str | None = None,
              parse: Callable[[str], Any] | None = None) -> dict[str, Any]:
    """Field metadata that `add_cli_args` turns into the flag's help text.

    A field whose default is None must say in `text` what None means ("default: ...",
    "none = ..."), since "(default: None)" tells a user nothing. `group` files the flag under
    another `--help` heading than its class's; `flag` names it when the field's name is not
    what a user types (`duration_s` -> `--duration`); `parse` reads a value the field's type
    alone cannot (a rate that may be 'inf').
    """
    meta: dict[str, Any] = {"help": text}
    for key, value in (("group", group), ("flag", flag), ("parse", parse)):
        if value is not None:
            meta[key] = value
    return meta


def require_at_least(minimum: int, values: dict[str, int | None]) -> None:
    """ValueError naming the first of `values` (each by its field's name, or the flag that sets
    it) below `minimum`; None is a value not given. The range check every config's
    __post_init__ makes, spelled once."""
    for name, value in values.items():
        if value is not None and value < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {value}")


def option(default: Any, text: str, group: str | None = None, flag: str | None = None,
           parse: Callable[[str], Any] | None = None) -> Any:
    """A field that is a flag: its `default` (`list`: a fresh empty list each time, as
    default_factory gives it) and `flag_help(text, group, flag, parse)`."""
    return flag_field(default, flag_help(text, group, flag, parse))


def flag_field(default: Any, metadata: dict[str, Any]) -> Any:
    """The dataclass field of `option` (and of the command line's own options, whose
    metadata says more): `default` as `option` reads it."""
    if default is list:
        return field(default_factory=list, metadata=metadata)
    return field(default=default, metadata=metadata)


def base_url_field(default: Any = dataclasses.MISSING, purpose: str = "") -> Any:
    """--base-url, declared once for every command that talks to a running server (bench's
    server under test, eval's remote scoring): `default` MISSING makes it required; `purpose`
    says what the command does there."""
    return field(default=default, metadata=flag_help(
        "root of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (a trailing /v1 is "
        "fine)" + purpose))


def server_root(base_url: str) -> str:
    """`base_url` without a trailing / or /v1: OpenAI clients include /v1, /metrics lacks it."""
    return base_url.rstrip("/").removesuffix("/v1")


@dataclass(frozen=True)
class ModelConfig:
    CLI_GROUP = "Model"

    model: str | None = option(None,
        "GGUF file or Hugging Face folder; default: the bundled SmolLM2-135M-Instruct")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = option("auto",
        "weight and activation dtype (the KV cache's: --kv-cache-dtype); auto = bfloat16 on "
        "CUDA, float32 on CPUs (bfloat16 costs accuracy: README, --dtype)")
    device: Literal["auto", "cpu", "cuda"] = option("auto",
        "auto = cuda when available, else cpu")
    max_model_len: int | None = option(None,
        "longest prompt + output in tokens; default: the model's context length")
    generation_config: str = option("auto",
        "sampling defaults of requests that set none of temperature, top_p, top_k, "
        "repetition_penalty: auto = the model's (generation_config.json, a GGUF's "
        "general.sampling.* keys; the bundled model's card: temperature 0.2, top_p 0.9), "
        "loom's (1.0, 1.0, off, 1.0) for what it does not set; none = loom's only; or a "
        "folder or generation_config.json to read them from")
    num_threads: int | None = option(None,
        "CPU threads for torch; default: the cores this process may use")
    attention_backend: Literal["auto", "native", "torch"] = option("auto",
        "decode attention: native = loom's C++ paged kernel (CPU; compiled on first use; "
        "block_size 16, head_dim 64/128/256), torch = gather + SDPA; auto = native where it "
        "builds and fits, else torch")
    linear_backend: Literal["auto", "native", "onednn", "torch"] = option("auto",
        "projection matmuls: native = loom's C++ kernel on a GGUF's own Q4_0/Q4_1/Q8_0 "
        "weights (CPU float32, AVX2); onednn = "
        "weights prepacked once for oneDNN (CPU float32); torch = F.linear on plain "
        "weights; auto = the first of these that applies")
    batched_matmul: Literal["auto", "native", "bfloat16"] = option("auto",
        "matmuls of more than 1 row, 3 on CPUs with AMX (prefill chunks, batched decode) "
        "when the native kernel runs: native = the kernel itself; bfloat16 = bf16 copies "
        "of the weights (loom's AMX kernel where the CPU has AMX, else oneDNN; 2 bytes a "
        "weight more memory; fast only with native bf16; on CPUs with AMX the attention "
        "of long prefill chunks then runs in bf16 too; faster, but on an AVX-512 EPYC "
        "its top-1 prediction left float32's more often than 1 in 100 at 32 sequences: "
        "BENCHMARKS.md); auto = native")
    batch_invariant: bool = option(False,
        "the same prompt with the same seed gives the same tokens whatever else shares the "
        "batch: every matmul on the native kernel's per-row int8 path, every prompt token's "
        "attention a query of its own in the paged kernel, so neither the batch's rows nor "
        "prefill chunk boundaries change a request's numerics (loom.model.batch_invariant); "
        "needs a GGUF the native kernel takes, on CPU")

    def __post_init__(self) -> None:
        if self.batch_invariant and self.batched_matmul == "bfloat16":
            raise ValueError("batch_invariant runs every matmul on the native kernel's per-row "
                             "path; batched_matmul 'bfloat16' would send wide calls to bf16 "
                             "copies: use 'auto' or 'native'")
        require_at_least(2, {"max_model_len": self.max_model_len})
        require_at_least(1, {"num_threads": self.num_threads})
        if self.generation_config not in ("auto", "none") and \
                not Path(self.generation_config).exists():
            raise ValueError("generation_config must be auto, none or an existing folder or "
                             f"generation_config.json, got {self.generation_config!r}")


def check_device(device: str) -> None:
    """Refuse `--device cuda` where torch cannot use CUDA, in a sentence naming the flag,
    before the model loads; torch itself fails deep in its lazy init with an AssertionError.
    torch is imported only when cuda is asked for by name (this module stays light)."""
    if device != "cuda":
        return
    import torch

    if not torch.backends.cuda.is_built():
        raise ValueError(f"--device cuda: CUDA is not available in this torch build "
                         f"({torch.__version__}, CPU only); use --device cpu or install a "
                         "CUDA build of torch")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: torch sees no CUDA device here (driver missing or "
                         "CUDA_VISIBLE_DEVICES empty); use --device cpu")


@dataclass(frozen=True)
class CacheConfig:
    CLI_GROUP = "KV cache"

    block_size: int = option(16, "tokens per KV cache block")
    num_kv_blocks: int | None = option(None,
        "number of KV blocks; overrides --kv-cache-memory; default: sized from it")
    kv_cache_memory: str | None = option(None,
        "KV cache size, e.g. 2GiB; default: 25%% of available RAM (at most 4 GiB) on CPU, "
        "85%% of free GPU memory")
    enable_prefix_caching: bool = option(True,
        "reuse KV blocks of shared prompt prefixes")
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "float32"] = option("auto",
        "KV cache element type; auto = float16 where the model runs in float32 on CPU with the "
        "native decode kernel (half the bytes a token, as llama.cpp stores it; scores stay "
        "float32), else the model's dtype")

    def __post_init__(self) -> None:
        require_at_least(1, {"block_size": self.block_size, "num_kv_blocks": self.num_kv_blocks})
        if self.kv_cache_memory is not None and parse_size(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `--speculative-config` for the n-gram method: `{"method": "ngram",
    "num_speculative_tokens": K, "prompt_lookup_max": N, "prompt_lookup_min": M}`. Given
    one of the lookup bounds, the other defaults to it; given neither, both are 5 (as vLLM)."""

    method: Literal["ngram"] = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative_config method {self.method!r} is not supported; "
                             "loom implements 'ngram' (prompt lookup)")
        if not isinstance(self.num_speculative_tokens, int) or \
                not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("speculative_config num_speculative_tokens must be an integer in "
                             f"[1, 16], got {self.num_speculative_tokens!r}")
        low = self.prompt_lookup_min or self.prompt_lookup_max or 5
        high = self.prompt_lookup_max or low
        object.__setattr__(self, "prompt_lookup_min", low)
        object.__setattr__(self, "prompt_lookup_max", high)
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high <= 32):
            raise ValueError("speculative_config needs 1 <= prompt_lookup_min <= "
                             f"prompt_lookup_max <= 32, got {low!r} and {high!r}")

    @classmethod
    def from_json(cls, text: str | dict[str, Any]) -> SpeculativeConfig:
        """The flag's JSON (or its dict); unknown keys are refused by name."""
        try:
            values = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError as e:
            raise ValueError(f"speculative_config is not valid JSON: {e}") from e
        if not isinstance(values, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; loom takes "
                             f"{sorted(known)}")
        return cls(**values)


@dataclass(frozen=True)
class SchedulerConfig:
    CLI_GROUP = "Scheduling"

    max_num_batched_tokens: int = option(2048,
        "token budget of one scheduler step (decodes + prefill chunks)")
    max_num_seqs: int = option(128, "sequences in one step at most")
    enable_chunked_prefill: bool = option(True,
        "split prompts longer than the remaining budget across steps")
    scheduler: Literal["continuous", "static"] = option("continuous",
        "continuous batching, or the fixed-batch baseline")
    scheduling_policy: Literal["fcfs", "priority"] = option("fcfs",
        "admission order: arrival, or per-request priority (lower first)")
    async_scheduling: bool = option(False,
        "schedule step N+1 and stream step N-1's tokens while step N runs on the model")
    speculative_config: str | None = option(None,
        "speculative decoding as JSON, e.g. '{\"method\": \"ngram\", "
        "\"num_speculative_tokens\": 3, \"prompt_lookup_max\": 4, "
        "\"prompt_lookup_min\": 2}'; default: off")

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            spec = SpeculativeConfig.from_json(self.speculative_config)  # validates
            object.__setattr__(self, "speculative_config", json.dumps(dataclasses.asdict(spec)))
            if self.async_scheduling:
                raise ValueError("speculative_config needs the plain step loop: drafts are "
                                 "looked up from the tokens the previous step sampled; "
                                 "drop async_scheduling")
        require_at_least(1, {"max_num_batched_tokens": self.max_num_batched_tokens,
                             "max_num_seqs": self.max_num_seqs})
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError("max_num_seqs cannot exceed max_num_batched_tokens "
                             f"({self.max_num_seqs} > {self.max_num_batched_tokens})")

    @property
    def speculative(self) -> SpeculativeConfig | None:
        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_json(self.speculative_config)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    SECTIONS = ("model", "cache", "scheduler")

    def __post_init__(self) -> None:
        """A field typed as a Literal takes one of its values: the CLI's choices say so, and
        `LLM(...)` keywords, which no parser sees, are checked here, once."""
        for name in self.SECTIONS:
            section = getattr(self, name)
            hints = typing.get_type_hints(type(section))
            for f in dataclasses.fields(section):
                choices = flag_type(hints[f.name])[1]
                value = getattr(section, f.name)
                if choices is not None and value not in choices:
                    raise ValueError(f"{f.name} must be one of "
                                     f"{', '.join(map(repr, choices))}; got {value!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Flat keyword arguments (as `LLM(...)` takes them) -> nested config."""
        sections = {}
        for name in cls.SECTIONS:
            section_cls = field_type(cls, name)
            own = {f.name for f in dataclasses.fields(section_cls)}
            sections[name] = section_cls(**{k: kwargs.pop(k) for k in list(kwargs) if k in own})
        if kwargs:
            raise TypeError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        return cls(**sections)


def field_type(cls: type, name: str) -> type:
    """The dataclass type of `cls`'s field `name` (an EngineConfig section's class)."""
    return typing.get_type_hints(cls)[name]


def flag_type(hint: Any) -> tuple[Any, list[Any] | None]:
    """(argparse type, choices) for a field's type hint (`X | None` is X; a wider union needs
    its own `parse`)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        return flag_type(inner[0]) if len(inner) == 1 else (str, None)
    if origin is Literal:
        choices = list(typing.get_args(hint))
        return type(choices[0]), choices
    return hint, None


def flag_name(f: dataclasses.Field) -> str:
    """The flag of a field: `--max-num-seqs` for `max_num_seqs`, unless its metadata names one."""
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


