"""Trace generation, the JSONL format, hashing and ShareGPT import (`loom bench trace`)."""

from __future__ import annotations

import hashlib
import json
import random

import pytest
from bench_helpers import bundled_synth

from loom.bench.client import completion_payload
from loom.bench.importers import import_sharegpt
from loom.cli.main import main
from loom.workload.mix import CLASSES, ArrivalSpec, CancelSpec, generate_mix, parse_mix
from loom.workload.tokens import PromptSynth
from loom.workload.trace import Trace, TraceRequest, fill_prompts, load_trace, write_trace

pytestmark = pytest.mark.unit

MIX = "chat=0.6,long=0.15,rag=0.25"


@pytest.fixture(scope="module")
def synth() -> PromptSynth:
    return bundled_synth()


@pytest.fixture(scope="module")
def mix_trace(synth: PromptSynth) -> Trace:
    return generate_mix(parse_mix(MIX), 150, 1, synth, ArrivalSpec(), CancelSpec(0.2), "tok")


def test_lengths_within_the_stated_distributions(mix_trace: Trace, synth: PromptSynth) -> None:
    classes = mix_trace.header["classes"]
    assert set(classes) == {"chat", "long", "rag"}
    for r in mix_trace.requests:
        spec = classes[r.cls]
        question = r.prompt_len - spec["shared_prefix_len"]
        assert spec["prompt_len"]["low"] <= question <= spec["prompt_len"]["high"], r.id
        assert spec["output_len"]["low"] <= r.max_tokens <= spec["output_len"]["high"], r.id
        assert synth.count(r.prompt) == r.prompt_len  # counted in the model's tokens


def test_rag_requests_share_a_480_token_prefix(mix_trace: Trace, synth: PromptSynth) -> None:
    rag = [r for r in mix_trace.requests if r.cls == "rag"]
    assert len(rag) >= 10
    ids = [synth.tokenizer.encode(r.prompt, add_special_tokens=False).ids for r in rag]
    assert all(i[:480] == ids[0][:480] for i in ids)
    assert len({tuple(i[480:]) for i in ids}) > 1


def test_mix_cancellations_and_bursts(mix_trace: Trace) -> None:
    counts = {c: sum(r.cls == c for r in mix_trace.requests) for c in CLASSES}
    assert counts["chat"] > counts["rag"] > counts["long"] > 0
    cancels = [r.cancel_after_s for r in mix_trace.requests if r.cancel_after_s is not None]
    assert 10 <= len(cancels) <= 50  # 20% of 150
    assert all(0.5 <= c <= 5.0 for c in cancels)
    arrivals = [r.arrival_s for r in mix_trace.requests]
    assert arrivals == sorted(arrivals)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    # bursts put several requests inside half a second; Poisson alone at 2/s rarely would
    assert sum(g < 0.1 for g in gaps) > 10


def test_same_seed_same_file_other_seed_other_file(synth: PromptSynth, tmp_path) -> None:
    def make(seed: int, name: str) -> str:
        trace = generate_mix(parse_mix(MIX), 20, seed, synth, ArrivalSpec(), CancelSpec(), "t")
        return write_trace(trace, tmp_path / name)

    assert make(7, "a.jsonl") == make(7, "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert make(8, "c.jsonl") != make(7, "a.jsonl")


def test_trace_hash_is_the_file_sha256(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text('{"header": {"kind": "mine"}}\n{"prompt": "hi", "max_tokens": 3}\n')
    trace = load_trace(path)
    assert trace.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert trace.header == {"kind": "mine"}
    path.write_text('{"header": {"kind": "mine"}}\n{"prompt": "hi", "max_tokens": 4}\n')
    assert load_trace(path).sha256 != trace.sha256


def test_own_logs_replay_as_they_are(tmp_path, synth: PromptSynth) -> None:
    path = tmp_path / "log.jsonl"
    lines = [{"prompt": "Hello there", "output_len": 5, "class": "chat", "arrival_s": 0.5,
              "priority": 1, "id": "x"},
             {"prompt_len": 33, "max_tokens": 7, "cancel_after_s": 2}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    trace = load_trace(path)
    first, second = trace.requests
    assert (first.max_tokens, first.cls, first.arrival_s, first.priority) == (5, "chat", 0.5, 1)
    assert second.prompt is None and second.cancel_after_s == 2
    fill_prompts(trace, synth, seed=3)
    assert synth.count(second.prompt) == 33
    assert first.prompt == "Hello there"


def test_a_requests_temperature_reaches_the_payload_and_survives_a_rewrite(tmp_path) -> None:
    path = tmp_path / "greedy.jsonl"
    path.write_text(json.dumps({"prompt": "Quote this", "max_tokens": 4, "temperature": 0})
                    + "\n" + json.dumps({"prompt": "Say anything", "max_tokens": 4}) + "\n")
    greedy, default = load_trace(path).requests
    assert completion_payload(greedy, "m")["temperature"] == 0
    assert "temperature" not in completion_payload(default, "m")  # the server's default
    write_trace(Trace([greedy, default]), tmp_path / "again.jsonl")
    assert [r.temperature for r in load_trace(tmp_path / "again.jsonl").requests] == [0, None]


@pytest.mark.parametrize("line, message", [
    ('{"prompt": "x"}', "max_tokens"),
    ('{"max_tokens": 3}', "prompt"),
    ('{"prompt": "x", "max_tokens": 3, "arrival_s": -1}', "arrival_s"),
    ('{"prompt": "x", "max_tokens": 3, "temperature": 3}', "temperature"),
    ('{"prompt": "x", "max_tokens": 3, "temperature": "hot"}', "temperature"),
    ("not json", "not JSON"),
])
def test_bad_lines_name_the_line(tmp_path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 1}\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl:2.*{message}"):
        load_trace(path)


def test_parse_mix() -> None:
    assert parse_mix("chat=3,rag=1") == {"chat": 0.75, "rag": 0.25}
    with pytest.raises(ValueError, match="unknown request class"):
        parse_mix("video=1")


def test_sharegpt_import(tmp_path, synth: PromptSynth) -> None:
    rng = random.Random(0)
    conversations = [
        {"conversations": [{"from": "human", "value": synth.text(40, rng)},
                           {"from": "gpt", "value": synth.text(25, rng)}]},
        {"messages": [{"role": "system", "content": "be nice"},
                      {"role": "user", "content": synth.text(12, rng)},
                      {"role": "assistant", "content": synth.text(9, rng)}]},
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"conversations": [{"from": "human", "value": synth.text(1500, rng)},
                           {"from": "gpt", "value": synth.text(10, rng)}]},
    ]
    source = tmp_path / "sharegpt.json"
    source.write_text(json.dumps(conversations))
    trace = import_sharegpt(source, None, 0, synth, ArrivalSpec(), CancelSpec(0.0), "t")
    assert sorted((r.prompt_len, r.max_tokens) for r in trace.requests) == [(12, 9), (40, 25)]
    assert all(r.cls == "sharegpt" and r.arrival_s is not None for r in trace.requests)


def test_cli_writes_header_and_requests(tmp_path, synth: PromptSynth) -> None:
    tokenizer = tmp_path / "tokenizer.json"  # a Hugging Face tokenizer file works as well
    synth.tokenizer.save(str(tokenizer))
    out = tmp_path / "t.jsonl"
    assert main(["bench", "trace", "--mix", "chat=1", "-n", "5", "--seed", "2", "-o",
                 str(out), "--cancel-fraction", "0", "--tokenizer", str(tokenizer)]) == 0
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert lines[0]["header"]["tokenizer"] == "tokenizer.json"
    assert lines[0]["header"]["classes"]["chat"]["output_len"] == {
        "kind": "uniform", "low": 16, "high": 96}
    assert len(lines) == 6 and all("cancel_after_s" not in x for x in lines[1:])
    assert TraceRequest.from_json(lines[1], "x").cls == "chat"
