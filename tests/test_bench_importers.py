"""Traces from logs (OpenAI-style JSONL, Azure CSV, Mooncake JSONL), anonymization and the
session class, on small sample files written from each format's published columns."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from bench_helpers import bundled_synth

from loom.bench.anonymize import anonymize, block_hashes
from loom.bench.importers import Classifier, import_log
from loom.cli.main import main
from loom.workload.mix import ArrivalSpec, CancelSpec, generate_mix, parse_mix
from loom.workload.tokens import PromptSynth
from loom.workload.trace import load_trace

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data"
OPENAI, AZURE, MOONCAKE = (DATA / "openai_requests.jsonl", DATA / "azure_llm_trace.csv",
                           DATA / "mooncake_trace.jsonl")


@pytest.fixture(scope="module")
def synth() -> PromptSynth:
    return bundled_synth()


def _ids(synth: PromptSynth, text: str) -> list[int]:
    return synth.tokenizer.encode(text, add_special_tokens=False).ids


def test_azure_csv_keeps_arrivals_and_lengths(synth: PromptSynth) -> None:
    trace = import_log(AZURE, "azure", synth, Classifier(), time_scale=0.5)
    assert [r.prompt_len for r in trace.requests] == [374, 396, 879, 91, 91, 2048, 21, 650]
    assert [r.max_tokens for r in trace.requests] == [44, 109, 55, 16, 31, 9, 312, 1]
    # seconds after the first request, halved by --time-scale 0.5
    assert trace.requests[0].arrival_s == 0.0
    assert trace.requests[1].arrival_s == pytest.approx((50.9951690 - 46.6805900) / 2, abs=1e-4)
    assert trace.requests[-1].arrival_s == pytest.approx((56.0202780 - 46.6805900) / 2, abs=1e-4)
    assert [r.cls for r in trace.requests] == ["chat", "chat", "long", "chat", "chat", "long",
                                               "chat", "long"]
    assert all(r.prompt is None for r in trace.requests)  # counts only: filled at replay


def test_mooncake_hash_ids_become_shared_synthetic_prefixes(synth: PromptSynth) -> None:
    trace = import_log(MOONCAKE, "mooncake", synth, Classifier(), hash_block_size=512)
    first, second, third, fourth = (_ids(synth, r.prompt) for r in trace.requests[:4])
    assert [r.prompt_len for r in trace.requests] == [1300, 1100, 300, 1536, 480, 700]
    assert len(first) == 1300 and len(fourth) == 1536  # lengths in the target's tokens
    assert first[:1024] == second[:1024] and first[1024:1100] != second[1024:1100]
    assert second[:1100] == fourth[:1100]  # hash_ids [0, 1, 3] are a prefix of [0, 1, 3, 5]
    assert third[:10] != first[:10]
    assert trace.requests[5].prompt.startswith(trace.requests[2].prompt)  # [4, 7] after [4]
    assert [r.arrival_s for r in trace.requests] == [0.0, 0.85, 1.203, 2.975, 3.1, 4.65]
    # the default rules: a shared prefix of >= 256 tokens is RAG-like, then long prompts
    assert [r.cls for r in trace.requests] == ["long", "rag", "chat", "rag", "chat", "rag"]


def test_openai_log_counts_in_target_tokens_with_tenants_and_sessions(synth) -> None:
    trace = import_log(OPENAI, "openai", synth, Classifier("long:prompt_len>=500,chat:*"))
    first, _, third, fourth, fifth = trace.requests
    assert first.prompt.startswith("system: You are the support assistant")
    assert first.prompt_len == len(_ids(synth, first.prompt))
    answer = "Your parcel QX778 is in transit and should reach the depot tomorrow morning."
    assert first.max_tokens == len(_ids(synth, answer))  # the logged answer, re-counted
    assert trace.requests[1].max_tokens == 41  # usage.completion_tokens when no text
    assert fifth.max_tokens == 32 and fifth.tenant == "globex"  # the request's own limit
    assert fifth.arrival_s == pytest.approx(7.75)  # epoch seconds next to ISO strings
    assert [r.tenant for r in trace.requests] == ["acme", "globex", "acme", "initech", "globex"]
    assert third.session == first.session == "conv-1" and third.after == first.id
    assert fourth.after is None and third.prompt.startswith(first.prompt)


def test_classify_rules() -> None:
    rules = Classifier("vip:tenant=acme,long:prompt_len>=500&output_len<100,short:*")
    assert rules({"prompt_len": 900, "output_len": 10, "prefix_len": 0, "tenant": "acme"}) == "vip"
    assert rules({"prompt_len": 900, "output_len": 10, "prefix_len": 0, "tenant": None}) == "long"
    assert rules({"prompt_len": 900, "output_len": 200, "prefix_len": 0, "tenant": "x"}) == "short"
    with pytest.raises(ValueError, match="bad condition"):
        Classifier("long:prompt_length>5")
    with pytest.raises(ValueError, match="bad --classify rule"):
        Classifier("nocolon")


def test_anonymize_keeps_lengths_and_prefixes_and_leaks_no_word(synth: PromptSynth) -> None:
    original = import_log(OPENAI, "openai", synth, Classifier())
    anonymous = anonymize(original, synth, seed=3)
    words = {w for r in original.requests for w in re.findall(r"[a-z]+", r.prompt.lower())}
    for before, after in zip(original.requests, anonymous.requests):
        assert after.prompt_len == before.prompt_len == len(_ids(synth, after.prompt))
        assert after.max_tokens == before.max_tokens and after.arrival_s == before.arrival_s
        assert not words & set(re.findall(r"[a-z]+", after.prompt.lower()))
        assert before.tenant is None or after.tenant.startswith("tenant-")
    # same prefix blocks before -> same blocks after, and no more than that
    for a, b in [(0, 2), (0, 3), (2, 3), (1, 4)]:
        ids_a, ids_b = (_ids(synth, original.requests[i].prompt) for i in (a, b))
        new_a, new_b = (_ids(synth, anonymous.requests[i].prompt) for i in (a, b))
        shared = _shared_blocks(ids_a, ids_b)
        assert _shared_blocks(new_a, new_b) == shared
        assert new_a[:16 * shared] == new_b[:16 * shared]
    assert _shared_blocks(*(_ids(synth, original.requests[i].prompt) for i in (0, 3))) >= 2
    assert anonymous.requests[2].after == anonymous.requests[0].id
    text = json.dumps([r.to_json() for r in anonymous.requests]) + json.dumps(anonymous.header)
    for secret in ("Zanzibar", "QX778", "acme", "globex", "conv-1", "openai_requests"):
        assert secret.lower() not in text.lower()


def _shared_blocks(a: list[int], b: list[int]) -> int:
    return sum(x == y for x, y in zip(block_hashes(a, 16), block_hashes(b, 16)))


def test_sessions_grow_the_conversation_turn_by_turn(synth: PromptSynth) -> None:
    trace = generate_mix(parse_mix("chat=0.5,session=0.5"), 40, 2, synth, ArrivalSpec(),
                         CancelSpec(0.0), "tok")
    turns = [r for r in trace.requests if r.cls == "session"]
    assert len(turns) == 20 and sum(r.cls == "chat" for r in trace.requests) == 20
    by_id = {r.id: r for r in turns}
    followers = [r for r in turns if r.after]
    assert followers
    for r in followers:
        before = by_id[r.after]
        assert r.session == before.session and r.prompt.startswith(before.prompt)
        # the whole previous turn (prompt + an answer of its length) plus a new message
        assert r.prompt_len > before.prompt_len + before.max_tokens
        assert 1.0 <= r.think_s <= 5.0 and r.arrival_s >= before.arrival_s + r.think_s - 1e-3
    assert [r.arrival_s for r in trace.requests] == sorted(r.arrival_s for r in trace.requests)


def test_cli_from_log_anonymized(tmp_path: Path, capsys) -> None:
    out = tmp_path / "t.jsonl"
    try:
        rc = main(["bench", "trace", "--from-log", str(MOONCAKE), "--format", "mooncake",
                   "--time-scale", "2", "--anonymize", "-o", str(out)])
    except ValueError as e:  # pragma: no cover - without the bundled model
        pytest.skip(str(e))
    assert rc == 0 and "wrote 6 requests" in capsys.readouterr().out
    trace = load_trace(out)
    assert trace.header["source"] == {"format": "mooncake"}
    assert [r.arrival_s for r in trace.requests][-1] == pytest.approx(9.3)
    again = tmp_path / "u.jsonl"
    main(["bench", "trace", "--from-log", str(MOONCAKE), "--format", "mooncake",
          "--time-scale", "2", "--anonymize", "-o", str(again)])
    assert again.read_bytes() == out.read_bytes()
