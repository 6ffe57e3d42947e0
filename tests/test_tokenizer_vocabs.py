"""loom's GGUF tokenizers against llama.cpp's own tokenizer tests.

Each vocab-only GGUF in llama.cpp's models/ comes with `.inp` (the inputs, separated by a
line `__ggml_vocab_test__`) and `.out` (one line of expected ids per input, written by the
model's own Hugging Face tokenizer). llama.cpp's tests/test-tokenizer-0.cpp reads them the
way `llama_cpp_cases` does and tokenizes with add_special=false, parse_special=false; loom's
`encode(text, add_special_tokens=False)` must give the same ids for every input (none of the
inputs holds a special token's text, so parse_special does not matter), and decoding those ids
must give the input back. Every case of every vocabulary matches: there are no known
differences to document.

The vocabularies cover the three GGUF tokenizer models loom rebuilds: byte-level BPE with its
pre-tokenizers (gpt-2, llama-bpe, qwen2, qwen35, deepseek-llm, command-r), SentencePiece with
scores and byte fallback (llama-spm, phi-3) and Gemma 4's SentencePiece-style BPE (gemma-4).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import pytest
from llama_cpp_tree import llama_cpp_tree

from loom.model.gguf_file import read_gguf
from loom.model.model_files import tokenizer_from_gguf
from loom.model.tokenizer import Tokenizer

VOCABS = ["qwen2", "qwen35", "llama-bpe", "llama-spm", "phi-3", "gemma-4", "gpt-2",
          "deepseek-llm", "command-r"]
SEPARATOR = "\n__ggml_vocab_test__\n"

pytestmark = pytest.mark.integration


def vocab_path(name: str) -> Path:
    return llama_cpp_tree() / "models" / f"ggml-vocab-{name}.gguf"


def llama_cpp_cases(path: Path) -> list[tuple[str, list[int]]]:
    """(input, expected ids) as test-tokenizer-0.cpp's read_tests reads them: inputs split on
    the separator (a trailing one ends the last input, it starts no new one), one line of
    space-separated ids per input."""
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")
    inputs, at = [], 0
    while at < len(raw):
        end = raw.find(SEPARATOR, at)
        if end == -1:
            inputs.append(raw[at:])
            break
        inputs.append(raw[at:end])
        at = end + len(SEPARATOR)
    outputs = Path(f"{path}.out").read_text().split("\n")
    assert len(outputs) >= len(inputs), f"{path}.out has fewer lines than {path}.inp inputs"
    return [(text, [int(t) for t in line.split()]) for text, line in zip(inputs, outputs)]


@cache
def _tokenizer(name: str) -> Tokenizer:
    return tokenizer_from_gguf(read_gguf(vocab_path(name)).metadata)


@pytest.fixture(scope="module", params=VOCABS)
def vocab(request: pytest.FixtureRequest) -> tuple[str, Tokenizer]:
    """One vocabulary at a time (pytest groups the tests by it), freed after its tests."""
    yield request.param, _tokenizer(request.param)
    _tokenizer.cache_clear()


def test_the_cases_are_read_as_llama_cpp_reads_them() -> None:
    cases = llama_cpp_cases(vocab_path("llama-spm"))
    assert len(cases) == 46  # the shared input file ends with a separator: no empty 47th
    assert ("", []) in cases and (" ", [259]) in cases
    assert any(text == "Hello world" and ids == [15043, 3186] for text, ids in cases)


def test_every_case_tokenizes_as_llama_cpp_expects(vocab: tuple[str, Tokenizer]) -> None:
    name, tokenizer = vocab
    cases = llama_cpp_cases(vocab_path(name))
    wrong = [(text, ids, got) for text, ids in cases
             if (got := tokenizer.encode(text, add_special_tokens=False)) != ids]
    assert not wrong, (f"{len(wrong)} of {len(cases)} {name} cases differ; first: "
                       f"{wrong[0][0]!r}: expected {wrong[0][1]}, got {wrong[0][2]}")


def test_decoding_gives_every_case_back(vocab: tuple[str, Tokenizer]) -> None:
    name, tokenizer = vocab
    cases = llama_cpp_cases(vocab_path(name))
    wrong = [text for text, ids in cases if tokenizer.decode(ids) != text]
    assert not wrong, f"{len(wrong)} of {len(cases)} {name} cases decode differently: {wrong}"


# llama.cpp's BOS rule: the file's add_bos_token, else on for SentencePiece and the Llama-3
# pre-tokenizer (llama-bpe has no flag in its file), forced on for Gemma 4.
ADDS_BOS = {"qwen2": False, "qwen35": False, "llama-bpe": True, "llama-spm": True,
            "phi-3": True, "gemma-4": True, "gpt-2": False, "deepseek-llm": True,
            "command-r": True}


def test_bos_is_added_as_llama_cpp_adds_it(vocab: tuple[str, Tokenizer]) -> None:
    name, tokenizer = vocab
    plain = tokenizer.encode("Hello world", add_special_tokens=False)
    with_special = tokenizer.encode("Hello world")
    if ADDS_BOS[name]:
        assert with_special == [tokenizer.bos_token_id, *plain]
    else:
        assert with_special == plain


# The end-of-turn tokens llama.cpp stops on besides the file's EOS (which comes first).
ENDS_GENERATION = {"qwen2": {"<|endoftext|>", "<|im_end|>"},
                   "phi-3": {"<|endoftext|>", "<|end|>", "</s>"},
                   "gemma-4": {"<eos>", "<turn|>", "<|tool_response>"},
                   "llama-bpe": {"<|end_of_text|>", "<|eot_id|>"},  # Llama 3.0: no eom
                   "llama-spm": {"</s>"}}


def test_generation_ends_on_the_end_of_turn_tokens(vocab: tuple[str, Tokenizer]) -> None:
    name, tokenizer = vocab
    meta_eos = read_gguf(vocab_path(name)).metadata["tokenizer.ggml.eos_token_id"]
    assert tokenizer.eos_token_ids[0] == meta_eos
    if name in ENDS_GENERATION:
        texts = {tokenizer.backend.id_to_token(i) for i in tokenizer.eos_token_ids}
        assert texts == ENDS_GENERATION[name]


def test_special_tokens_are_one_token_and_user_defined_ones_stay_in_the_text() -> None:
    qwen = _tokenizer("qwen2")
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 151644 and ids[-1] == 151645
    assert qwen.decode(ids) == "user\nhi"  # control tokens are skipped
    gemma = _tokenizer("gemma-4")
    call = gemma.encode('<|tool_call>call:f{}<tool_call|>', add_special_tokens=False)
    assert call[0] == 48 and call[-1] == 49  # USER_DEFINED tokens, matched whole
    assert gemma.decode([2, *call]) == '<|tool_call>call:f{}<tool_call|>'  # <bos> skipped
    _tokenizer.cache_clear()


def test_sentencepiece_spaces_bytes_and_the_prefix_after_special_tokens() -> None:
    phi = _tokenizer("phi-3")
    hello = phi.encode("Hello", add_special_tokens=False)
    assert [phi.backend.id_to_token(i) for i in hello] == ["\u2581Hello"]
    assert phi.token_bytes(hello[0]) == b" Hello" and phi.id_to_token(hello[0]) == " Hello"
    newline = phi.backend.token_to_id("<0x0A>")
    assert phi.token_bytes(newline) == b"\n"
    # llama.cpp puts the prefix space before the text after every special token, too
    assert phi.encode("<|user|>Hello", add_special_tokens=False) == [32010, *hello]
    # a character the vocabulary lacks falls back to its UTF-8 bytes
    text = "\U0001f999"
    ids = phi.encode(text, add_special_tokens=False)
    assert b"".join(phi.token_bytes(i) for i in ids) == b" " + text.encode()
    assert phi.decode(ids) == text
    _tokenizer.cache_clear()


def test_streamed_text_adds_up_to_the_decoded_whole(vocab: tuple[str, Tokenizer]) -> None:
    """What the engine streams (IncrementalDetokenizer, after a prompt) and the pieces
    /v1/completions' logprobs and echo give each token (TokenPieces) join into the text a
    whole decode gives, for every case: no space of SentencePiece's lost at a window's
    start, no character split across tokens shown twice."""
    from loom.engine.detokenizer import IncrementalDetokenizer
    from loom.entrypoints.openai.serving_completion import token_pieces

    name, tokenizer = vocab
    prompt = tokenizer.encode("Answer:", add_special_tokens=False)
    for text, ids in llama_cpp_cases(vocab_path(name)):
        assert "".join(token_pieces(tokenizer, ids)) == tokenizer.decode(ids), text
        streamed = IncrementalDetokenizer(tokenizer, prompt, stop=[])
        for token_id in ids:
            streamed.push(token_id)
        whole = tokenizer.decode([*prompt, *ids])
        assert streamed.text == whole[len(tokenizer.decode(prompt)):], text


def test_harmony_tokens_stay_in_the_text_and_end_as_llama_cpp_ends() -> None:
    """gpt-oss (o200k_harmony): <|channel|> and <|message|> are rendered, as llama.cpp
    renders them, so the text shows which channel is the answer; <|return|> and <|call|>
    end it, and <|end|> (the end of one message) then does not."""
    tokens = ["a", "b", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>",
              "<|endoftext|>"]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": [],
            "tokenizer.ggml.token_type": [1, 1, 3, 3, 3, 3, 3, 3],
            "tokenizer.ggml.eos_token_id": 5}
    tokenizer = tokenizer_from_gguf(meta)
    assert tokenizer.decode([2, 0, 3, 1, 5]) == "<|channel|>a<|message|>b"
    assert tokenizer.eos_token_ids == [5, 6, 7]
