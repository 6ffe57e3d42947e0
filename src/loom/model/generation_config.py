"""The model's own sampling defaults (vLLM's `--generation-config auto`).

A request that leaves temperature, top_p, top_k or repetition_penalty unset gets what the
model's authors set: a Hugging Face folder's generation_config.json, a GGUF's
`general.sampling.*` keys (gguf-py's `Keys.General.SAMPLING_*`: temp, top_p, top_k,
penalty_repeat), and for the bundled SmolLM2-135M-Instruct, whose GGUF carries none, the
values its model card samples with (temperature 0.2, top_p 0.9). What the model does not set
is loom's default: temperature 1.0, top_p 1.0, top_k off, repetition_penalty 1.0 (OpenAI's
and vLLM's). `--generation-config none` uses loom's defaults alone; a folder or a
generation_config.json path reads that file instead of the model's (for a GGUF converted from
a folder whose generation_config.json was left behind).

torch-free: the server reads the engine's answer (`EngineFacts`), the engine resolves it once.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from loom.sampling import SamplingParams, SamplingParamsError

logger = logging.getLogger(__name__)

# gguf-py's names (Keys.General.SAMPLING_*) -> SamplingParams' fields
GGUF_SAMPLING_KEYS = {"general.sampling.temp": "temperature",
                      "general.sampling.top_p": "top_p",
                      "general.sampling.top_k": "top_k",
                      "general.sampling.penalty_repeat": "repetition_penalty"}


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request gets for each sampling field it leaves unset; `source` says where the
    values came from (the start-up log and /v1/models' reader see it)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    repetition_penalty: float = 1.0
    source: str = "loom's defaults"

    def params(self, **fields_set: Any) -> SamplingParams:
        """SamplingParams with these defaults and `fields_set` over them (a request that
        names only its length, say)."""
        return SamplingParams(**{"temperature": self.temperature, "top_p": self.top_p,
                                 "top_k": self.top_k,
                                 "repetition_penalty": self.repetition_penalty, **fields_set})

    def overridden(self) -> dict[str, float | int]:
        """The fields whose value is not loom's own default."""
        loom = LOOM_DEFAULTS
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.name != "source" and getattr(self, f.name) != getattr(loom, f.name)}


LOOM_DEFAULTS = SamplingDefaults()
# SmolLM2-135M-Instruct's model card samples with these; its GGUF records no sampling keys.
BUNDLED_MODEL_DEFAULTS = SamplingDefaults(temperature=0.2, top_p=0.9,
                                          source="SmolLM2-135M-Instruct's model card")


def defaults_from(values: Mapping[str, Any], source: str) -> SamplingDefaults | None:
    """loom's defaults with `values` (SamplingParams' field names) over them, None if there
    are none; a value that SamplingParams would refuse is left out with a warning, not
    passed on to every request."""
    if not values:
        return None
    defaults = LOOM_DEFAULTS
    for name, value in values.items():
        try:
            SamplingParams(**{name: value})
        except (SamplingParamsError, TypeError) as e:
            logger.warning("%s: ignoring %s=%r: %s", source, name, value, e)
            continue
        defaults = replace(defaults, **{name: value})
    return replace(defaults, source=source)


def from_generation_config(config: Mapping[str, Any], source: str) -> SamplingDefaults | None:
    """generation_config.json's sampling fields (transformers' names are SamplingParams')."""
    names = ("temperature", "top_p", "top_k", "repetition_penalty")
    values = {name: config[name] for name in names if config.get(name) is not None}
    if values.get("top_k") == 0:  # transformers' "no top-k"
        values["top_k"] = -1
    return defaults_from(values, source)


def from_gguf_metadata(meta: Mapping[str, Any], source: str) -> SamplingDefaults | None:
    values = {field: meta[key] for key, field in GGUF_SAMPLING_KEYS.items() if key in meta}
    if values.get("top_k") == 0:  # llama.cpp's "no top-k"
        values["top_k"] = -1
    return defaults_from(values, source)


def read_generation_config(path: Path) -> SamplingDefaults:
    """A generation_config.json (or the folder holding one) that --generation-config names."""
    file = path / "generation_config.json" if path.is_dir() else path
    if not file.exists():
        raise ValueError(f"generation_config: {str(file)!r} does not exist")
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"generation_config: cannot read {str(file)!r}: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"generation_config: {str(file)!r} is not a JSON object")
    return from_generation_config(config, str(file)) or LOOM_DEFAULTS


def resolve(choice: str, model: str | None, from_model_files: SamplingDefaults | None
            ) -> SamplingDefaults:
    """The defaults `--generation-config choice` gives for the model at `model` (None: the
    bundled one), whose own files said `from_model_files` (None: nothing)."""
    if choice == "none":
        defaults = LOOM_DEFAULTS
    elif choice == "auto":
        defaults = (BUNDLED_MODEL_DEFAULTS if model is None
                    else from_model_files or LOOM_DEFAULTS)
    else:
        defaults = read_generation_config(Path(choice))
    if defaults.overridden():
        logger.info("requests that leave them unset sample with %s (from %s)",
                    ", ".join(f"{k}={v}" for k, v in defaults.overridden().items()),
                    defaults.source)
    return defaults
