"""The model's own tokenizer (fast BPE from `tokenizers`) plus its chat template."""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's pre-tokenizer names -> the equivalent `tokenizers` pre-tokenizer. The SmolLM /
# StarCoder family splits every digit into its own token before the GPT-2 regex.
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 differs from Llama-3 only in taking digits one at a time (\p{N}, not \p{N}{1,3}).
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r"}
_GPT2 = {"gpt2", "default", "mpt", "olmo", "jais"}
_LLAMA3 = {"llama-bpe", "llama3", "smaug-bpe", "dbrx"}
_QWEN2 = {"qwen2", "stablelm2"}


def gguf_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in _GPT2:
        return byte_level
    if pre in _LLAMA3 or pre in _QWEN2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(pattern=Regex(_LLAMA3_REGEX if pre in _LLAMA3 else _QWEN2_REGEX),
                                 behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; load a Hugging Face folder instead")


def bpe_from_gguf_metadata(meta: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer stored in a GGUF file's metadata (`gguf_file.read_gguf`). Only
    byte-level BPE is supported; the model type is checked first because a SentencePiece
    vocabulary has no merges to read."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (only byte-level BPE); "
                         "use the model's Hugging Face folder or tokenizer.json instead")
    return bpe_from_gguf(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.merges"],
                         meta["tokenizer.ggml.token_type"],
                         meta.get("tokenizer.ggml.pre", "default"))


def bpe_from_gguf(tokens: list[str], merges: list[str], token_types: list[int],
                  pre: str) -> HFTokenizer:
    """Rebuild a byte-level BPE tokenizer from GGUF vocabulary, merges and token types."""
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    tokenizer.pre_tokenizer = gguf_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    control = [tokens[i] for i, kind in enumerate(token_types) if kind in (3, 4)]  # CONTROL, USER
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    return tokenizer


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte (GPT-2's bytes_to_unicode), inverted:
    printable bytes stand for themselves, the others for 256 + their rank."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1),
                 *range(ord("\xae"), ord("\xff") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_OF_CHAR = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass
class Tokenizer:
    backend: HFTokenizer
    eos_token_ids: list[int]
    bos_token_id: int | None = None
    add_bos_token: bool = False
    chat_template: str | None = None

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # The backend's post-processor adds what the model expects (Llama-3's tokenizer.json adds
        # <|begin_of_text|> there, with no add_bos_token in tokenizer_config.json), as in
        # transformers; GGUF-built tokenizers have none and rely on add_bos_token below.
        # encode_batch releases the GIL while it works (encode does not): the server then
        # keeps streaming while a worker thread tokenizes a long prompt.
        ids = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """A token's text as it reads on its own (byte-level pieces decoded)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, which may begin or end inside a UTF-8 character (id_to_token
        shows such a token as U+FFFD): OpenAI's logprobs `bytes`, which clients join to
        rebuild characters split across tokens."""
        raw = self.backend.id_to_token(token_id)
        if raw is not None and token_id not in self._added_token_ids:
            if type(self.backend.decoder).__name__ == "ByteLevel":
                if all(c in _BYTE_OF_CHAR for c in raw):
                    return bytes(_BYTE_OF_CHAR[c] for c in raw)
            elif (byte := _BYTE_FALLBACK.fullmatch(raw)) is not None:  # SentencePiece's
                return bytes([int(byte[1], 16)])
            else:
                return raw.replace("\u2581", " ").encode()
        return self.id_to_token(token_id).encode()

    @functools.cached_property
    def _added_token_ids(self) -> frozenset[int]:
        return frozenset(self.backend.get_added_tokens_decoder())

    @functools.cached_property
    def special_token_texts(self) -> tuple[str, ...]:
        """The texts of the special tokens ("<|im_end|>"): what encode() turns into control
        tokens wherever they occur."""
        return tuple(t.content for t in self.backend.get_added_tokens_decoder().values()
                     if t.special)

    def encode_plain(self, text: str) -> list[int]:
        """`text` tokenized with any special-token text in it as plain text, never as the
        control token (no BOS either): what a chat message's own text must become, so that a
        user cannot write a turn of the template's."""
        return self._plain_backend.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def _plain_backend(self) -> HFTokenizer:
        plain = HFTokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    @property
    def template_has_tools(self) -> bool:
        """The chat template renders tools itself (Llama-3.1, Qwen2.5, Mistral do; SmolLM2's
        does not, and gets loom's hermes-style tool prompt instead)."""
        return "tools" in (self.chat_template or "")

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """`messages` as transformers takes them (tool calls' arguments as dicts); `tools`
        as OpenAI's request lists them."""
        if not self.template_has_tools:
            messages, tools = hermes_tool_messages(messages, tools), None
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        # Imported here: the engine process never renders a template, and jinja2 is one of the
        # larger imports on its way to ready (the server has imported it by now).
        import jinja2.sandbox

        # The environment transformers renders chat templates in: loop controls ({% break %}),
        # a tojson that keeps non-ASCII and '<' as they are, strftime_now, raise_exception.
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
                   separators: Any = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                              separators=separators, sort_keys=sort_keys)

        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = tojson
        template = env.from_string(self.chat_template)
        special = lambda i: self.backend.id_to_token(i) if i is not None else ""  # noqa: E731
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                               tools=tools, bos_token=special(self.bos_token_id),
                               eos_token=special(self.eos_token_id))


_HERMES_TOOLS = (
    "You may call one or more functions to assist with the user query. The functions you "
    "can call are listed within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, answer with a JSON object holding the function's name and arguments "
    "within <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def hermes_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                         ) -> list[dict[str, Any]]:
    """A conversation with tools for a template that knows none, in the hermes format Qwen2.5's
    template writes: the tools in the system message, calls as <tool_call> blocks in the
    assistant's text, tool results as <tool_response> blocks of a user turn."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            blocks = [json.dumps({"name": c["function"]["name"],
                                  "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                      for c in m["tool_calls"]]
            text = (m.get("content") or "") + "".join(
                f"\n<tool_call>\n{b}\n</tool_call>" for b in blocks)
            out.append({"role": m["role"], "content": text.lstrip("\n")})
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    if tools:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        prompt = _HERMES_TOOLS.format(tools=listed)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
