"""A GGUF's vocabulary rebuilt as a `tokenizers` tokenizer (fast, no Python loop per token).

A GGUF stores no tokenizer.json: only the tokens, their types and scores, the merges of a BPE
vocabulary, and two names, `tokenizer.ggml.model` (how tokens are found) and
`tokenizer.ggml.pre` (how text is cut before that). What each name means is llama.cpp's
definition (src/llama-vocab.cpp), and these builders reproduce it with the pieces the
`tokenizers` library has, in the shape the model's own tokenizer.json had:

- `gpt2`: byte-level BPE. Text is cut by the pre-tokenizer's regex (llama.cpp adapts a few
  regexes for its own engine; the originals, which `tokenizers` runs, are used here), each
  piece spelled in GPT-2's byte alphabet, then merged by rank.
- `llama`: SentencePiece (Llama 2, Phi-3, Gemma 1-3). No merges are stored: llama.cpp merges
  the adjacent pair whose union is the highest-scored token, so the merges are rebuilt from
  the scores (one per way to cut a token in two, best-scored union first). Spaces are `▁`;
  `tokenizer.ggml.add_space_prefix` (default on) puts one before the text and after every
  special token, as llama.cpp does; characters the vocabulary lacks fall back to their
  `<0xNN>` byte tokens.
- `gemma4`: BPE over raw UTF-8 with the file's merges, spaces as `▁`, cut only at runs of
  newlines (llama.cpp's "gemma4" pre-tokenizer), byte fallback as above.

Token types (llama.cpp's): CONTROL tokens are special (matched whole in text, dropped by
`decode(skip_special_tokens=True)`), USER_DEFINED ones are added tokens that stay in the text
(Qwen3's `<think>`, `<tool_call>`: the reasoning and tool parsers read them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp's token types (llama_token_type) that change how a token is built; UNKNOWN (2) and
# UNUSED (5) tokens are plain vocabulary here
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
SPACE = "\u2581"  # SentencePiece's visible space

# -- pre-tokenizers of byte-level vocabularies, by llama.cpp's names ---------------------------

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# Qwen2 differs from Llama-3 only in taking digits one at a time (\p{N}, not \p{N}{1,3});
# Qwen3.5 also keeps combining marks (\p{M}) with the letters before them.
_QWEN2_REGEX = _LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN35_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
                 r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# DeepSeek LLM's splits, applied one after the other: newlines, runs of Latin/Greek/Cyrillic
# letters, of ASCII and full-width punctuation, trailing blanks, CJK and Hangul, digits.
_DEEPSEEK_LLM_SPLITS = (
    r"[\r\n]",
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
    "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c"
    "\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0"
    "-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-"
    "\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b"
    "\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-"
    "\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113"
    "\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00"
    "-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
    "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    "\U000118df\U0001e900-\U0001e943]+",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
    "\\s+$",
    "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+",
    "\\p{N}+",
)
# The StarCoder family (SmolLM, Command-R, ...) splits every digit off before the GPT-2 regex.
_DIGIT_SPLIT = {"smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r"}
_GPT2 = {"gpt2", "gpt-2", "default", "mpt", "olmo", "jais"}
_SPLIT_THEN_BYTES = {
    **dict.fromkeys(("llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"), _LLAMA3_REGEX),
    **dict.fromkeys(("qwen2", "stablelm2", "deepseek-r1-qwen"), _QWEN2_REGEX),
    "qwen35": _QWEN35_REGEX,
}
# Llama 3's BPE takes a piece that is a token whole, without merging up to it (its
# tokenizer.json's ignore_merges; llama.cpp's too): "ĠViệt" is one token, which no merge reaches.
_IGNORE_MERGES = {"llama-bpe", "llama3", "llama-v3", "smaug-bpe", "dbrx"}
# These vocabularies' own tokenizers compose text to NFC before anything else.
_NFC = {"qwen2", "deepseek-r1-qwen", "command-r"}


def byte_level_pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The `tokenizers` pre-tokenizer for llama.cpp's byte-level pre-tokenizer `pre`."""
    if pre in _DIGIT_SPLIT:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    splits: Sequence[str]
    if pre in _SPLIT_THEN_BYTES:
        splits = (_SPLIT_THEN_BYTES[pre],)
    elif pre == "deepseek-llm":
        splits = _DEEPSEEK_LLM_SPLITS
    else:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; load the model's Hugging "
                         "Face folder (tokenizer.json) instead")
    return pre_tokenizers.Sequence([
        *(pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# -- the builders --------------------------------------------------------------------------------

# What each tokenizer model reads from the file besides the tokens
_NEEDS = {"gpt2": ("tokenizer.ggml.tokens", "tokenizer.ggml.merges"),
          "llama": ("tokenizer.ggml.tokens", "tokenizer.ggml.scores"),
          "gemma4": ("tokenizer.ggml.tokens", "tokenizer.ggml.merges")}


def backend_from_gguf(meta: Mapping[str, Any]) -> HFTokenizer:
    """The tokenizer stored in a GGUF file's metadata (`gguf_file.read_gguf`)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in _NEEDS:
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported (loom reads 'gpt2', "
                         "'llama' and 'gemma4' vocabularies); use the model's Hugging Face "
                         "folder or tokenizer.json instead")
    missing = [key for key in _NEEDS[kind] if key not in meta]
    if missing:
        raise ValueError(f"GGUF tokenizer {kind!r} needs {missing[0]}, which the file lacks")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, meta["tokenizer.ggml.merges"],
                                    meta.get("tokenizer.ggml.pre", "default"))
    elif kind == "llama":
        tokenizer = _sentencepiece(
            tokens, _merges_from_scores(tokens, types, meta["tokenizer.ggml.scores"]),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", True)),
            unk=_token(tokens, meta.get("tokenizer.ggml.unknown_token_id")))
    else:
        tokenizer = _sentencepiece(
            tokens, [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]],
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", False)),
            unk=None, split_newlines=True)
    _add_special_tokens(tokenizer, tokens, types)
    return tokenizer


def _token(tokens: list[str], token_id: int | None) -> str | None:
    return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str) -> HFTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False,
                                       ignore_merges=pre in _IGNORE_MERGES))
    if pre in _NFC:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = byte_level_pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float]
                        ) -> list[tuple[str, str]]:
    """SentencePiece's merge order as BPE merges: every way to cut a token in two halves that
    are both tokens, the token with the higher score first (llama.cpp merges the adjacent
    pair whose union scores highest; ties go to the lower id, as a merge list is read)."""
    ids = {token: i for i, token in enumerate(tokens)}
    merges: list[tuple[float, int, str, str]] = []
    for i, token in enumerate(tokens):
        if types[i] == BYTE:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                merges.append((-scores[i], i, left, right))
    merges.sort()
    return [(left, right) for _, _, left, right in merges]


def _sentencepiece(tokens: list[str], merges: list[tuple[str, str]],
                   add_space_prefix: bool, unk: str | None,
                   split_newlines: bool = False) -> HFTokenizer:
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=unk,
                                       fuse_unk=True, byte_fallback=True))
    # Prepend acts on each run of text between added tokens: llama.cpp's space after every
    # special token.
    escape = normalizers.Replace(" ", SPACE)
    tokenizer.normalizer = (normalizers.Sequence([normalizers.Prepend(SPACE), escape])
                            if add_space_prefix else escape)
    if split_newlines:
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|\n+"), behavior="isolated")
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:  # the space the prefix added is no text of the caller's
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


# gpt-oss's harmony format marks its answer's parts with these; llama.cpp always renders them
# (it retypes them USER_DEFINED), so that the text says which channel is the final answer.
_ALWAYS_RENDERED = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"})


def _add_special_tokens(tokenizer: HFTokenizer, tokens: list[str], types: list[int]) -> None:
    shown = [kind == USER_DEFINED or (kind == CONTROL and t in _ALWAYS_RENDERED)
             for t, kind in zip(tokens, types)]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind, show in zip(tokens, types, shown)
                                  if kind == CONTROL and not show])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False)
                          for t, show in zip(tokens, shown) if show])


# -- what a vocabulary's metadata says besides its tokens ----------------------------------------

# Tokens llama.cpp ends generation on wherever a vocabulary has them (llama-vocab.cpp's EOG
# list), besides the ids the file names: Gemma's <end_of_turn>, Phi-3's <|end|>, Qwen's
# <|im_end|>, gpt-oss's <|return|> and <|call|> ...
_END_OF_GENERATION = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\uff5cend\u2581of\u2581sentence\uff5c>", "[e~["})
# The llama.cpp pre-tokenizers (and models) whose BOS is added by default.
_ADDS_BOS = {"llama-bpe", "llama3", "llama-v3", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
             "lfm2", "jina-v5-nano", "tekken", "chameleon"}
# template variable -> the GGUF key of its id (llama.cpp spells "separator" this way)
_SPECIAL_TOKEN_KEYS = {"unk_token": "unknown_token_id", "pad_token": "padding_token_id",
                       "sep_token": "seperator_token_id", "mask_token": "mask_token_id"}


def end_of_generation_ids(meta: Mapping[str, Any]) -> list[int]:
    """Every id that ends generation, the file's EOS first (llama.cpp's rules: the EOS, EOT
    and EOM ids, and the tokens above; `<|end|>` only ends a message where `<|return|>` and
    `<|call|>` end the answer, as in gpt-oss's harmony format). Unlike llama.cpp, a token of
    those names that the file marks NORMAL is text, not an end: Qwen's vocabulary spells
    `</s>` as four characters a model may well write."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    named = [meta.get(f"tokenizer.ggml.{kind}_token_id") for kind in ("eos", "eot", "eom")]
    found = [i for i, t in enumerate(tokens) if t in _END_OF_GENERATION and types[i] != NORMAL]
    if {"<|return|>", "<|call|>"} <= {tokens[i] for i in found}:
        found = [i for i in found if tokens[i] != "<|end|>"]
    ids: list[int] = []
    for i in [*named, *found]:
        if isinstance(i, int) and 0 <= i < len(tokens) and i not in ids:
            ids.append(i)
    return ids


def adds_bos(meta: Mapping[str, Any]) -> bool:
    """Whether encoding a prompt puts BOS first: the file's flag, else llama.cpp's default
    (SentencePiece vocabularies and the Llama-3 family do; Gemma 4 always does)."""
    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind == "gemma4":
        return True
    default = kind == "llama" or pre in _ADDS_BOS
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def special_token_texts(meta: Mapping[str, Any]) -> dict[str, str]:
    """unk_token, pad_token, ... as a chat template names them (those the file sets)."""
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    found = {name: meta.get(f"tokenizer.ggml.{key}") for name, key in _SPECIAL_TOKEN_KEYS.items()}
    return {name: tokens[i] for name, i in found.items()
            if isinstance(i, int) and 0 <= i < len(tokens)}
