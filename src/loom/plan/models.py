"""Which model to plan for: a well-known architecture shipped as shape data (models.json), or a
GGUF / Hugging Face folder / config.json on disk, of which only the header or config is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from loom.model.arch import ModelArch, ModelLoadError, arch_from_hf_config, read_arch
from loom.plan.catalogue import PlanError


@dataclass(frozen=True)
class PlanModel:
    """A model's shape plus what the serve commands need to name it. `gguf_weight_bytes`:
    the tensors' size as the GGUF stores them (its own quantization), None for other kinds.
    `hub_id`: a known model's Hugging Face name, which vLLM fetches by itself; loom reads
    models from disk only, so its command names the folder a download makes."""

    name: str
    arch: ModelArch
    serve_name: str  # what to pass as --model / vllm serve's model
    gguf_weight_bytes: int | None = None
    hub_id: str | None = None

    @property
    def loom_model(self) -> str:
        """What `loom serve --model` takes: the path given, or a known model's download."""
        return f"./{self.hub_id.split('/')[-1]}" if self.hub_id else self.serve_name

    @property
    def download(self) -> str | None:
        """The command that puts a known model where `loom_model` says."""
        if self.hub_id is None:
            return None
        return f"hf download {self.hub_id} --local-dir {self.loom_model}"


def known_models() -> dict[str, dict]:
    text = resources.files("loom.plan").joinpath("models.json").read_text()
    return json.loads(text)["models"]


def resolve_model(text: str | None) -> PlanModel:
    """A known name (case-insensitive), a path, or None for loom's bundled model."""
    known = known_models()
    if text is not None and text.lower() in known:
        entry = known[text.lower()]
        return PlanModel(text.lower(), arch_from_hf_config(entry["config"]), entry["hf_id"],
                         hub_id=entry["hf_id"])
    if text is None:
        from loom.model.arch import default_model_path

        path = default_model_path()
    else:
        path = Path(text)
    if not path.exists():
        raise PlanError(f"model {text!r} is neither a known architecture "
                        f"({', '.join(sorted(known))}) nor an existing GGUF, folder or "
                        "config.json")
    _check_hf_config(path)
    try:
        arch = read_arch(path)
    except ModelLoadError as e:
        raise PlanError(str(e)) from None
    gguf_bytes = _gguf_tensor_bytes(path) if path.suffix == ".gguf" else None
    folder = path.parent if path.name == "config.json" else path
    name = path.stem if path.suffix == ".gguf" else folder.resolve().name  # not "config"
    return PlanModel(name, arch, str(folder), gguf_bytes)


# config.json fields the plan divides and multiplies: a string there ("32") would fail deep
# in the arithmetic as a TypeError
_SHAPE_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                 "max_position_embeddings")


def _check_hf_config(path: Path) -> None:
    """A Hugging Face config's shape fields are positive integers (where given), else an
    error naming the field and the file."""
    config_path = path / "config.json" if path.is_dir() else path
    if config_path.suffix != ".json" or not config_path.is_file():
        return  # read_arch says what is wrong with it
    try:
        config = json.loads(config_path.read_text())
    except (OSError, ValueError) as e:
        raise PlanError(f"cannot read {str(config_path)!r}: {e}") from None
    if not isinstance(config, dict):
        raise PlanError(f"{config_path}: not a JSON object")
    for key in _SHAPE_FIELDS:
        value = config.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise PlanError(f"{config_path}: {key} must be a positive integer, got {value!r}")


def _gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in the file (mapped, not read)."""
    from loom.model.gguf_file import read_gguf

    return sum(t.data.nbytes for t in read_gguf(path).tensors)
