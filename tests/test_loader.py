"""The loader: clear ModelLoadError messages for every way a model path can be wrong, and the
config.json / GGUF metadata it must read correctly (both config layouts, sliding windows, RoPE
scaling, tokenizer settings)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_fixtures import (
    EOS_ID,
    TINY_SPECS,
    Chunk,
    TinySpec,
    build_tiny_model,
    make_runner,
    save_hf_folder,
    step_logits,
    write_gguf,
)

from loom.model.arch import ModelLoadError
from loom.model.decoder import DecoderModel, rope_inv_freq
from loom.model.loader import load_model
from loom.model.weights import LazyWeights

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tiny_llama():
    return build_tiny_model(TINY_SPECS["llama"])


@pytest.fixture(scope="module")
def hf_folder(tiny_llama, tmp_path_factory):
    return save_hf_folder(tiny_llama, tmp_path_factory.mktemp("llama") / "hf")


@pytest.fixture(scope="module")
def gguf_file(tiny_llama, tmp_path_factory):
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def copy_folder(src, dst, skip=()):
    dst.mkdir()
    for f in src.iterdir():
        if f.name not in skip:
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_config(folder, **changes):
    path = folder / "config.json"
    config = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    path.write_text(json.dumps(config))


# -- errors -----------------------------------------------------------------------------------

@pytest.mark.unit
def test_model_load_error_is_a_value_error():
    assert issubclass(ModelLoadError, ValueError)


@pytest.mark.unit
def test_lazy_weights_make_each_tensor_once_when_first_asked():
    made = []
    weights = LazyWeights({"a": lambda: made.append("a") or torch.ones(2)})
    assert "a" in weights and "b" not in weights and list(weights) == ["a"] and len(weights) == 1
    assert weights.get("b") is None and made == []
    assert weights["a"] is weights["a"] and made == ["a"]


@pytest.mark.unit
def test_unknown_path(tmp_path):
    with pytest.raises(ModelLoadError, match=r"does not exist") as info:
        load_model(str(tmp_path / "no-such-model"))
    assert "no-such-model" in str(info.value)


@pytest.mark.unit
def test_directory_without_config_json(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"has no config\.json"):
        load_model(str(tmp_path))


@pytest.mark.unit
def test_file_that_is_neither_gguf_nor_folder(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"neither a \.gguf file nor a Hugging Face folder"):
        load_model(str(path))


@pytest.mark.unit
@pytest.mark.parametrize("content", [os.urandom(4096), b"", b"GGUF\x03\x00\x00\x00" + b"\xff" * 64],
                         ids=["random-bytes", "empty", "bad-header"])
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match=r"cannot load model .*broken\.gguf"):
        load_model(str(path))


@pytest.mark.integration
def test_truncated_gguf(tmp_path, gguf_file):
    path = tmp_path / "truncated.gguf"
    path.write_bytes(gguf_file.read_bytes()[: gguf_file.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match=r"cannot load model .*truncated\.gguf"):
        load_model(str(path))


@pytest.mark.integration
def test_unsupported_architecture_in_hf_folder(tmp_path, hf_folder):
    folder = copy_folder(hf_folder, tmp_path / "gpt2")
    edit_config(folder, model_type="gpt2")
    with pytest.raises(ModelLoadError, match=r"unsupported model_type 'gpt2'.*llama"):
        load_model(str(folder))


@pytest.mark.integration
@pytest.mark.parametrize("name,options,message", [
    ("falcon.gguf", {"arch": "falcon"}, r"unsupported architecture 'falcon'.*falcon\.gguf"),
    ("pre.gguf", {"pre": "no-such-pre"}, r"pre-tokenizer 'no-such-pre'"),
])
def test_unsupported_gguf_contents_are_named(tmp_path, tiny_llama, name, options, message):
    path = write_gguf(tiny_llama, tmp_path / name, **options)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path))


@pytest.mark.integration
@pytest.mark.parametrize("model,message", [
    ("bert", r"GGUF tokenizer 'bert' is not supported"),
    # SentencePiece is read, but from its scores: a file without them says so, no KeyError
    ("llama", r"GGUF tokenizer 'llama' needs tokenizer\.ggml\.scores"),
])
def test_unsupported_gguf_tokenizer_is_named(tmp_path, tiny_llama, monkeypatch, model,
                                             message):
    import gguf

    real = gguf.GGUFWriter.add_tokenizer_model
    monkeypatch.setattr(gguf.GGUFWriter, "add_tokenizer_model",
                        lambda self, _: real(self, model))
    path = write_gguf(tiny_llama, tmp_path / "other.gguf")
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(path))


@pytest.mark.integration
@pytest.mark.parametrize("missing,message", [
    ("model.safetensors", r"no \*\.safetensors weights"),
    ("tokenizer.json", r"no tokenizer\.json"),
])
def test_hf_folder_missing_files(tmp_path, hf_folder, missing, message):
    folder = copy_folder(hf_folder, tmp_path / "partial", skip={missing})
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(folder))


@pytest.mark.unit
@pytest.mark.parametrize("value", ["32", 0, 2.5, True])
def test_a_shape_field_of_the_wrong_type_is_named(tmp_path, hf_folder, value):
    """Once a TypeError deep in the arithmetic, in loom serve, plan and simulate alike."""
    folder = copy_folder(hf_folder, tmp_path / "typed")
    edit_config(folder, num_attention_heads=value)
    with pytest.raises(ModelLoadError, match="num_attention_heads must be a positive integer"):
        load_model(str(folder))


@pytest.mark.integration
def test_missing_weights_are_named(tmp_path, hf_folder):
    from safetensors.torch import load_file, save_file

    folder = copy_folder(hf_folder, tmp_path / "missing")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    loaded = load_model(str(folder))
    with pytest.raises(ModelLoadError, match=r"missing 1 tensors.*layers\.1\.mlp\.up_proj"):
        DecoderModel(loaded.arch, loaded.weights, torch.float32, torch.device("cpu"))


@pytest.mark.integration
def test_unsupported_rope_scaling_is_named(tmp_path, hf_folder):
    folder = copy_folder(hf_folder, tmp_path / "yarn")
    edit_config(folder, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                         "factor": 4.0})
    loaded = load_model(str(folder))
    with pytest.raises(ModelLoadError, match=r"unsupported rope_scaling type 'yarn'"):
        DecoderModel(loaded.arch, loaded.weights, torch.float32, torch.device("cpu"))


# -- what the loader reads --------------------------------------------------------------------

@pytest.mark.integration
def test_hf_folder_tokenizer_settings(hf_folder):
    tok = load_model(str(hf_folder)).tokenizer
    assert tok.eos_token_ids == [EOS_ID]
    assert tok.bos_token_id == 0  # config.json's bos_token_id (tokenizer_config has none)
    assert not tok.add_bos_token
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok.encode("hello world 42")) == "hello world 42"


@pytest.mark.integration
def test_hf_folder_tokenizer_post_processor_bos_like_transformers(tmp_path, hf_folder):
    """Llama-3's tokenizer.json adds <|begin_of_text|> in its post-processor and its
    tokenizer_config.json has no add_bos_token: plain prompts must still get the BOS, as
    transformers (and vLLM through it) give them; chat templates, encoded without special
    tokens, must not get a second one."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors
    from transformers import AutoTokenizer

    folder = copy_folder(hf_folder, tmp_path / "bos")
    backend = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template":
         "<|endoftext|>{% for m in messages %}{{ m['content'] }}{% endfor %}"}))
    ours = load_model(str(folder)).tokenizer
    theirs = AutoTokenizer.from_pretrained(str(folder))
    for text in ["hello world", "", "<|endoftext|>twice"]:
        assert ours.encode(text) == theirs(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == \
            theirs(text, add_special_tokens=False).input_ids, text
    assert ours.encode("hi")[0] == 0
    chat = ours.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ours.encode(chat, add_special_tokens=False).count(0) == 1


@pytest.mark.integration
def test_chat_template_environment_like_transformers(tmp_path, hf_folder):
    """Templates may use {% break %}, tojson (transformers' keeps non-ASCII and '<'),
    strftime_now and raise_exception; loom renders them as transformers does."""
    from transformers import AutoTokenizer

    folder = copy_folder(hf_folder, tmp_path / "template")
    template = ("{%- for m in messages %}{% if m['role'] == 'stop' %}{% break %}{% endif %}"
                "{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}"
                "{% if strftime_now is defined %}dated{% endif %}"
                "{% if messages | length > 3 %}{{ raise_exception('too many') }}{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "chat_template": template}))
    messages = [{"role": "user", "content": "<b>café</b> & \"x\""},
                {"role": "stop", "content": ""}, {"role": "user", "content": "unseen"}]
    ours = load_model(str(folder)).tokenizer.apply_chat_template(messages, False)
    theirs = AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(messages,
                                                                           tokenize=False)
    assert ours == theirs == 'user: "<b>café</b> & \\"x\\""\ndated'
    with pytest.raises(ValueError, match="too many"):
        load_model(str(folder)).tokenizer.apply_chat_template(messages * 2)


@pytest.mark.integration
def test_gguf_tokenizer_equals_hf_folder_tokenizer(hf_folder, gguf_file):
    """The same byte-level BPE rebuilt from GGUF tokens/merges/token types ('gpt2' pre-tokenizer
    = plain byte-level, as the tiny tokenizer was trained) encodes every string identically,
    specials included."""
    hf = load_model(str(hf_folder)).tokenizer
    from_gguf_path = gguf_file.with_name("gpt2-pre.gguf")
    write_gguf(build_tiny_model(TINY_SPECS["llama"]), from_gguf_path, pre="gpt2")
    gg = load_model(str(from_gguf_path)).tokenizer
    for text in ["The quick brown fox", "def forward(self):\n    return 42\n",
                 "<|im_start|>user\nhello<|im_end|>", "  spaces   and\ttabs 2024 ünïcode"]:
        assert gg.encode(text) == hf.encode(text), text
    # the GGUF also ends on <|endoftext|> (id 0), as llama.cpp does for that name
    assert gg.eos_token_ids == [EOS_ID, 0] and hf.eos_token_ids == [EOS_ID]
    assert gg.chat_template == hf.chat_template


@pytest.mark.integration
def test_legacy_config_layout_loads_the_same(tmp_path, tiny_models_llama3_qwen2):
    """Hub configs written before transformers 5 have top-level rope_theta / rope_scaling
    instead of rope_parameters; both layouts must give the same frequencies and logits."""
    for model, folder in tiny_models_llama3_qwen2:
        params = dict(model.config.rope_parameters)
        legacy = copy_folder(folder, tmp_path / f"legacy-{model.config.model_type}")
        scaling = None if params["rope_type"] == "default" else {
            k: v for k, v in params.items() if k != "rope_theta"}
        edit_config(legacy, rope_parameters=None, rope_theta=params["rope_theta"],
                    rope_scaling=scaling)
        new, old = load_model(str(folder)), load_model(str(legacy))
        assert old.arch.rope_theta == new.arch.rope_theta == params["rope_theta"] != 10000.0
        torch.testing.assert_close(rope_inv_freq(old.arch), rope_inv_freq(new.arch))
        ids = list(range(3, 40))
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0]
        for loaded in (new, old):
            got = step_logits(make_runner(loaded), [_chunk(ids)])["a"]
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module")
def tiny_models_llama3_qwen2(tmp_path_factory):
    out = []
    for name in ("llama3", "qwen2"):
        model = build_tiny_model(TINY_SPECS[name])
        out.append((model, save_hf_folder(model, tmp_path_factory.mktemp(name) / "hf")))
    return out


def _chunk(ids):
    return Chunk("a", ids, 0, list(range(1, 1 + -(-len(ids) // 4))))


@pytest.mark.integration
def test_sliding_window_keeps_the_context_length(tmp_path):
    """A Mistral window no longer caps the context: loom attends through it (every layer
    slides, as transformers' Mistral), and past the window the logits still match."""
    spec = TinySpec("mistral-swa", "mistral", dict(TINY_SPECS["mistral"].config,
                                                   sliding_window=16), seed=5)
    model = build_tiny_model(spec)
    loaded = load_model(str(save_hf_folder(model, tmp_path / "swa")))
    assert loaded.arch.max_position_embeddings == 256
    assert loaded.arch.layer_types == ("sliding_attention",) * 2
    assert loaded.arch.sliding_window == 16
    ids = list(range(5, 45))
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    got = step_logits(make_runner(loaded), [_chunk(ids)])["a"]
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-5)


@pytest.mark.unit
def test_sliding_window_layers_as_transformers_derives_them():
    """Qwen2 configs carry sliding_window with use_sliding_window false: no window; with it,
    layers from max_window_layers on slide; layer_types, where given, decides; Mistral slides
    on every layer."""
    from loom.model.arch_hf import _hf_sliding

    qwen = {"sliding_window": 4096, "use_sliding_window": False, "max_window_layers": 2}
    assert _hf_sliding(qwen, "qwen2", 4) == (None, None)
    full, sliding = "full_attention", "sliding_attention"
    assert _hf_sliding({**qwen, "use_sliding_window": True}, "qwen2", 4) == (
        (full, full, sliding, sliding), 4096)
    assert _hf_sliding({**qwen, "use_sliding_window": True, "layer_types": [full] * 4},
                       "qwen2", 4) == (None, None)
    assert _hf_sliding({"sliding_window": 4096}, "mistral", 2) == ((sliding, sliding), 4096)
    assert _hf_sliding({"sliding_window": None}, "mistral", 2) == (None, None)


@pytest.mark.integration
def test_gguf_linear_rope_scaling_is_read(tmp_path, tiny_llama, monkeypatch):
    import gguf

    real = gguf.GGUFWriter.add_rope_freq_base

    def with_linear(self, base):
        real(self, base)
        self.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        self.add_rope_scaling_factor(4.0)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", with_linear)
    arch = load_model(str(write_gguf(tiny_llama, tmp_path / "linear.gguf"))).arch
    assert arch.rope_scaling == {"rope_type": "linear", "factor": 4.0}


@pytest.mark.integration
def test_gguf_unsupported_rope_scaling_is_named(tmp_path, tiny_llama, monkeypatch):
    import gguf

    real = gguf.GGUFWriter.add_rope_freq_base

    def with_yarn(self, base):
        real(self, base)
        self.add_rope_scaling_type(gguf.RopeScalingType.YARN)

    monkeypatch.setattr(gguf.GGUFWriter, "add_rope_freq_base", with_yarn)
    with pytest.raises(ModelLoadError, match=r"unsupported GGUF rope scaling 'yarn'"):
        load_model(str(write_gguf(tiny_llama, tmp_path / "yarn.gguf")))


# -- end of generation ------------------------------------------------------------------------

@pytest.mark.integration
def test_every_eos_id_of_an_hf_folder_ends_generation(tmp_path, hf_folder):
    """Llama-3.x-Instruct names one EOS in config.json and a list in generation_config.json;
    generation must stop at any of them, not only the first."""
    from loom import LLM, SamplingParams

    prompt = [5, 6, 7, 8]
    free = LLM(model=str(hf_folder), num_kv_blocks=16, dtype="float32")
    first = free.generate(prompt, SamplingParams(max_tokens=4, temperature=0,
                                                 ignore_eos=True))[0].outputs[0].token_ids[0]
    assert first != EOS_ID
    folder = copy_folder(hf_folder, tmp_path / "two-eos")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS_ID, first]}))
    assert load_model(str(folder)).tokenizer.eos_token_ids == [EOS_ID, first]

    llm = LLM(model=str(folder), num_kv_blocks=16, dtype="float32")
    out = llm.generate(prompt, SamplingParams(max_tokens=4, temperature=0))[0].outputs[0]
    assert out.token_ids == [first]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
