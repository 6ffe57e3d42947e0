"""Which model to plan for: a well-known architecture shipped as shape data (models.json), or a
GGUF / Hugging Face folder / config.json on disk, of which only the header or config is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from loom.model.arch import ModelArch, ModelLoadError
from loom.model.arch_hf import arch_from_hf_config
from loom.model.model_files import read_arch
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
    note: str | None = None  # what the shape stands in for, where it is not the model's own
    loom_runs: bool = True   # False for a shape of an architecture loom does not serve

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
                         hub_id=entry["hf_id"], note=entry.get("note"),
                         loom_runs=entry.get("loom_runs", True))
    if text is None:
        from loom.model.arch import default_model_path

        path = default_model_path()
    else:
        path = Path(text)
    if not path.exists():
        raise PlanError(f"model {text!r} is neither a known architecture "
                        f"({', '.join(sorted(known))}) nor an existing GGUF, folder or "
                        "config.json")
    try:
        arch = read_arch(path)
    except ModelLoadError as e:
        raise PlanError(str(e)) from None
    gguf_bytes = _gguf_tensor_bytes(path) if path.suffix == ".gguf" else None
    folder = path.parent if path.name == "config.json" else path
    name = path.stem if path.suffix == ".gguf" else folder.resolve().name  # not "config"
    return PlanModel(name, arch, str(folder), gguf_bytes)


def _gguf_tensor_bytes(path: Path) -> int:
    """Bytes of every tensor in the file (mapped, not read)."""
    from loom.model.gguf_file import read_gguf

    return sum(t.data.nbytes for t in read_gguf(path).tensors)
