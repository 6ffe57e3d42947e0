"""`loom eval`: perplexity as llama-perplexity computes it, KL divergence against a reference
(another setting, another model, saved logits), a server scored through /v1/completions, and
bad input refused with exit code 2 and a sentence naming it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from model_fixtures import TINY_SPECS, build_tiny_model, save_hf_folder
from server_helpers import serve

from loom.cli.main import main
from loom.eval.metrics import kl_divergence
from loom.eval.scores import ChunkScores
from loom.eval.text import bundled_text, chunks
from loom.model.arch import default_model_path

FAST = ["--context", "64", "--max-chunks", "4", "--log-level", "WARNING"]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["eval", *argv, *FAST, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    assert main(["eval", *argv]) == 2
    return capsys.readouterr().err


@pytest.mark.unit
def test_chunks_score_the_second_half_as_llama_perplexity() -> None:
    ids = list(range(100, 400))
    cut = chunks(ids, context=100)
    assert [c.token_ids[0] for c in cut] == [100, 200, 300]
    assert cut[0].first_scored == 51 and cut[0].targets == list(range(151, 200))
    assert [c.token_ids[0] for c in chunks(ids, 100, stride=50)] == [100, 150, 200, 250, 300]
    assert chunks(ids, 100, bos_token_id=1)[1].token_ids[:2] == [1, 201]
    with pytest.raises(ValueError, match="300 tokens, shorter than one chunk of --context 512"):
        chunks(ids, 512)


@pytest.mark.unit
def test_kld_of_a_distribution_with_itself_is_zero_and_top_n_is_a_lower_bound() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 8, 50)) * 3
    p, q = (torch.tensor(x).log_softmax(-1).numpy() for x in logits)
    targets = np.arange(8)
    ref, test = ChunkScores.from_full(targets, p), ChunkScores.from_full(targets, q)
    same = kl_divergence([ref], [ref])
    assert same.mean_kld == pytest.approx(0, abs=1e-12) and same.top1_agreement == 1.0
    exact = kl_divergence([ref], [test])
    expected = (np.exp(p) * (p - q)).sum(axis=1).mean()
    assert exact.mean_kld == pytest.approx(expected, rel=1e-9) and exact.exact
    top = np.argsort(-q, axis=1)[:, :5]
    bucketed = ChunkScores(targets, test.target_logprobs, np.take_along_axis(q, top, 1), top)
    bound = kl_divergence([ref], [bucketed])
    assert 0 < bound.mean_kld <= exact.mean_kld and not bound.exact
    with pytest.raises(ValueError, match="both sides have only their top-N"):
        kl_divergence([bucketed], [bucketed])


@pytest.mark.integration
def test_perplexity_is_what_transformers_float32_gives(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The tiny model in float32 on the torch path: loom's chunks and scores against the
    same chunks scored by transformers."""
    model = build_tiny_model(TINY_SPECS["llama"])
    folder = save_hf_folder(model, tmp_path / "hf")
    got = run_json(capsys, "perplexity", "--model", str(folder), "--dtype", "float32",
                   "--batch-size", "2")
    from loom.model.model_files import read_tokenizer

    ids = read_tokenizer(folder).encode(bundled_text().read_text(), add_special_tokens=False)
    total, count = 0.0, 0
    for chunk in chunks(ids, 64, max_chunks=4):
        with torch.no_grad():
            logprobs = model(torch.tensor([chunk.token_ids])).logits[0].log_softmax(-1)
        rows = logprobs[chunk.first_scored - 1:-1]
        total += rows.gather(1, torch.tensor(chunk.targets).unsqueeze(1)).sum().item()
        count += len(chunk.targets)
    assert got["tokens"] == count == 4 * 31
    assert got["perplexity"] == pytest.approx(math.exp(-total / count), rel=1e-4)
    assert math.isfinite(got["perplexity"]) and len(got["chunks"]) == 4


@pytest.mark.integration
def test_kld_against_itself_float32_and_saved_logits(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """The bundled model: itself as reference is 0 and 100%; the float32 reference vs the
    default with 4 sequences sharing each step is small but measurable; a saved run read
    back as the reference compares to itself."""
    decode = ["--batch-size", "4", "--as-decode"]
    itself = run_json(capsys, "kld", "--reference", str(default_model_path()), *decode)
    assert itself["mean_kld"] == pytest.approx(0, abs=1e-9)
    assert itself["top1_agreement"] == 1.0 and itself["delta_perplexity"] == 0
    saved = tmp_path / "ref.npz"
    vs_f32 = run_json(capsys, "kld", "--reference-dtype", "float32", *decode,
                      "--save-logits", str(saved))
    assert 1e-7 < vs_f32["mean_kld"] < 0.01 and vs_f32["p99_kld"] >= vs_f32["mean_kld"]
    assert vs_f32["top1_agreement"] > 0.9 and vs_f32["exact"]
    again = run_json(capsys, "kld", "--reference", str(saved), *decode)
    assert again["mean_kld"] < 1e-5 and again["top1_agreement"] == 1.0
    assert again["perplexity"] == pytest.approx(vs_f32["perplexity"], rel=1e-6)


@pytest.mark.integration
def test_base_url_scores_loom_serve_as_offline(capsys: pytest.CaptureFixture[str]) -> None:
    offline = run_json(capsys, "perplexity")
    with serve("--max-num-seqs", "4", "--kv-cache-memory", "256MiB") as url:
        online = run_json(capsys, "perplexity", "--base-url", url, "--batch-size", "2")
        bounded = run_json(capsys, "kld", "--reference-dtype", "float32",
                           "--base-url", url, "--top-n", "5")
    assert online["tokens"] == offline["tokens"]
    assert online["perplexity"] == pytest.approx(offline["perplexity"], rel=2e-3)
    assert not bounded["exact"] and 0 <= bounded["mean_kld"] < 0.01
    assert bounded["top1_agreement"] > 0.9


@pytest.mark.integration
def test_bad_input_is_named_with_exit_code_2(capsys: pytest.CaptureFixture[str],
                                             tmp_path: Path) -> None:
    assert "--text /no/such.txt: no such file" in refused(
        capsys, "perplexity", "--text", "/no/such.txt")
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert "the file is empty" in refused(
        capsys, "perplexity", "--text", str(tmp_path / "empty.txt"))
    (tmp_path / "short.txt").write_text("In the beginning")
    assert "shorter than one chunk of --context 512" in refused(
        capsys, "perplexity", "--text", str(tmp_path / "short.txt"), "--log-level", "WARNING")
    assert "kld needs a reference" in refused(capsys, "kld", *FAST)
    other = save_hf_folder(build_tiny_model(TINY_SPECS["llama"]), tmp_path / "other")
    assert "the model's vocabulary has 49152 tokens, the reference's 320" in refused(
        capsys, "kld", "--reference", str(other), *FAST)
