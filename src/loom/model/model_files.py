"""What a model path holds besides its weights, read without them: its shape (`read_arch`, for
`loom plan` and start-up) and its tokenizer (`read_tokenizer`, for a server process that
leaves running the model to another)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from loom.model.arch import ModelArch, ModelLoadError
from loom.model.arch_gguf import arch_from_gguf
from loom.model.arch_hf import arch_from_hf_config
from loom.model.gguf_file import read_gguf
from loom.model.tokenizer import Tokenizer


def read_arch(path: str | Path) -> ModelArch:
    """The shape of the model at `path` (a .gguf file, a Hugging Face folder or its
    config.json), reading only the header or the config."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        path = path / "config.json"
        if not path.exists():
            raise ModelLoadError(f"{str(path.parent)!r} has no config.json")
    if path.suffix == ".gguf":
        gguf_file = read_gguf(path)
        return arch_from_gguf(gguf_file.metadata, {t.name: t for t in gguf_file.tensors},
                              path.name)
    if path.suffix == ".json":
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {str(path)!r}: {e}") from e
        return arch_from_hf_config(config)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file, a Hugging Face folder nor a "
                         "config.json")


def read_tokenizer(path: str | Path) -> Tokenizer:
    """The tokenizer of the model at `path` (a .gguf file or a Hugging Face folder), without
    its weights: for a process that serves the model but leaves running it to another."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        return tokenizer_from_hf_folder(path, _read_json(path / "config.json"))
    if path.suffix == ".gguf":
        return tokenizer_from_gguf(read_gguf(path).metadata)
    raise ModelLoadError(f"{str(path)!r} is neither a .gguf file nor a Hugging Face folder")


def tokenizer_from_gguf(meta: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF's metadata describes (vocabulary, merges or scores, special ids,
    template, sampling defaults), by llama.cpp's rules (model/gguf_vocab.py)."""
    from loom.model import gguf_vocab
    from loom.model.generation_config import from_gguf_metadata

    return Tokenizer(
        backend=gguf_vocab.backend_from_gguf(meta),
        eos_token_ids=gguf_vocab.end_of_generation_ids(meta),
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        add_bos_token=gguf_vocab.adds_bos(meta),
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens=gguf_vocab.special_token_texts(meta),
        sampling_defaults=from_gguf_metadata(meta, "the GGUF's general.sampling keys"),
    )


def tokenizer_from_hf_folder(path: Path, config: Mapping[str, Any]) -> Tokenizer:
    """The tokenizer of a Hugging Face folder, with the end-of-sequence ids of all its files."""
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.exists():
        raise ModelLoadError(f"{str(path)!r} has no tokenizer.json")
    from tokenizers import Tokenizer as HFTokenizer

    from loom.model.generation_config import from_generation_config

    backend = HFTokenizer.from_file(str(tokenizer_file))
    tok_config = _read_json(path / "tokenizer_config.json")
    gen_config = _read_json(path / "generation_config.json")

    def token_id(value: Any) -> int | None:
        text = _token_text(value)
        return backend.token_to_id(text) if text is not None else None

    # Every id any of the three files names ends generation: Llama-3.x-Instruct's config.json
    # names <|end_of_text|> while its chat turns end with <|eot_id|> (generation_config.json).
    eos_ids: list[int] = []
    for value in (config.get("eos_token_id"), gen_config.get("eos_token_id"),
                  token_id(tok_config.get("eos_token"))):
        for eos in value if isinstance(value, list) else [value]:
            if isinstance(eos, int) and eos not in eos_ids:
                eos_ids.append(eos)
    bos_id = token_id(tok_config.get("bos_token"))
    if bos_id is None:
        bos_id = config.get("bos_token_id")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # the older list of named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"),
                        None)
    template_file = path / "chat_template.jinja"
    if template is None and template_file.exists():
        template = template_file.read_text()
    special = {name: text for name in ("unk_token", "pad_token", "sep_token", "mask_token")
               if (text := _token_text(tok_config.get(name))) is not None}
    return Tokenizer(backend=backend, eos_token_ids=eos_ids, bos_token_id=bos_id,
                     add_bos_token=bool(tok_config.get("add_bos_token", False)),
                     chat_template=template, special_tokens=special,
                     sampling_defaults=from_generation_config(
                         gen_config, str(path / "generation_config.json")))


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json names it: its text, or {"content": text}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.exists() else {}
