"""The model's tokenizer (fast, from `tokenizers`), its chat template and sampling defaults.

GGUF vocabularies are rebuilt by `gguf_vocab`, templates rendered by `chat_template`; this
module holds what the engine and the server call: encode, decode, the bytes of a token, the
conversation through the template.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer

if TYPE_CHECKING:  # the engine loop imports this module, and no more of model/ than it must
    from loom.model.generation_config import SamplingDefaults


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
    # The template's variables for special tokens (transformers' special_tokens_map:
    # unk_token, pad_token, ...); bos_token and eos_token default to the ids above.
    special_tokens: dict[str, str] = field(default_factory=dict)
    # What the model's own files say requests sample with (generation_config.json, a GGUF's
    # general.sampling.*; None: nothing); the engine decides whether they apply
    # (--generation-config, model/generation_config.py).
    sampling_defaults: SamplingDefaults | None = None

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
        """A token's text as it reads on its own (byte-level pieces decoded, SentencePiece's
        `▁` a space, also the one a whole text's decode strips from its start)."""
        if token_id in self._added_token_ids:
            return self.backend.id_to_token(token_id) or ""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int) -> bytes:
        """A token's own bytes, which may begin or end inside a UTF-8 character (id_to_token
        shows such a token as U+FFFD): OpenAI's logprobs `bytes`, which clients join to
        rebuild characters split across tokens."""
        raw = self.backend.id_to_token(token_id)
        if raw is None:
            return b""
        if token_id in self._added_token_ids:
            return raw.encode()
        if type(self.backend.decoder).__name__ == "ByteLevel":
            if all(c in _BYTE_OF_CHAR for c in raw):
                return bytes(_BYTE_OF_CHAR[c] for c in raw)
            return raw.encode()
        if (byte := _BYTE_FALLBACK.fullmatch(raw)) is not None:  # SentencePiece's
            return bytes([int(byte[1], 16)])
        return raw.replace("\u2581", " ").encode()

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

    @functools.cached_property
    def template_has_system_turn(self) -> bool:
        """The chat template renders a system turn (Gemma 2's refuses one: loom's tool prompt
        then opens the first user turn, where Gemma 3's template puts a system message)."""
        from loom.model.chat_template import ChatTemplateError, render_chat_template

        try:
            render_chat_template(self.chat_template or "", [
                {"role": "system", "content": "s"}, {"role": "user", "content": "u"}], None,
                True, self.template_variables)
        except ChatTemplateError:
            return False
        return True

    @property
    def template_variables(self) -> dict[str, str]:
        """The special tokens a template may name, as transformers passes them."""
        named = {"bos_token": self.bos_token_id, "eos_token": self.eos_token_id}
        found = {name: self.backend.id_to_token(i) for name, i in named.items()
                 if i is not None}
        return {**{k: v for k, v in found.items() if v is not None}, **self.special_tokens}

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """`messages` as transformers takes them (tool calls' arguments as dicts); `tools`
        as OpenAI's request lists them; `template_kwargs` (a request's chat_template_kwargs,
        e.g. enable_thinking) become variables of the template. Raises ChatTemplateError
        (a ValueError) for a conversation the template refuses."""
        from loom.model.chat_template import render_chat_template

        if _TOOLS_IN_SYSTEM_MESSAGE.search(self.chat_template or ""):
            messages, tools = phi4_tool_messages(messages, tools), None
        elif not self.template_has_tools:
            messages = hermes_tool_messages(messages, tools, self.template_has_system_turn)
            tools = None
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        return render_chat_template(self.chat_template, messages, tools, add_generation_prompt,
                                    {**self.template_variables, **(template_kwargs or {})})


# Phi-4-mini's template reads the tools from the system message (`message['tools']`, JSON
# text), not from a `tools` variable.
_TOOLS_IN_SYSTEM_MESSAGE = re.compile(r"message(\['tools'\]|\[\"tools\"\]|\.tools)")


def phi4_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
                       ) -> list[dict[str, Any]]:
    """A conversation with tools as Phi-4-mini's template takes it: the functions as JSON in
    the system message's `tools` (a system turn is added if there is none), earlier calls as
    the `functools[...]` text the model writes them in."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            listed = json.dumps([{"name": c["function"]["name"],
                                  "arguments": c["function"]["arguments"]}
                                 for c in m["tool_calls"]], ensure_ascii=False)
            out.append({**m, "content": f"{m.get('content') or ''}functools{listed}",
                        "tool_calls": None})
        else:
            out.append(m)
    if tools:
        listed = json.dumps([t["function"] for t in tools], ensure_ascii=False)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "tools": listed}
        else:
            out.insert(0, {"role": "system", "content": "", "tools": listed})
    return out


_HERMES_TOOLS = (
    "You may call one or more functions to assist with the user query. The functions you "
    "can call are listed within <tools></tools>:\n<tools>\n{tools}\n</tools>\n\nFor each "
    "function call, answer with a JSON object holding the function's name and arguments "
    "within <tool_call></tool_call> tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')


def hermes_tool_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                         system_turn: bool = True) -> list[dict[str, Any]]:
    """A conversation with tools for a template that knows none, in the hermes format Qwen2.5's
    template writes: the tools in the system message (without a `system_turn` in the
    template: at the start of the first user turn), calls as <tool_call> blocks in the
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
        first = "system" if system_turn else "user"
        if out and out[0]["role"] == first:
            out[0] = {"role": first, "content": f"{prompt}\n\n{out[0]['content']}"
                      if first == "user" else f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
