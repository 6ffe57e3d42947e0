"""Speculative decoding (n-gram prompt lookup): the proposer, the verification rule's
distribution, and the real engine loop with drafts on a stand-in model."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch
from stand_in import expected_output, make_engine

from loom.config import SchedulerConfig, SpeculativeConfig
from loom.core.spec_decode import DRAFT_ROW_COST, NgramProposer, drafts_worth_proposing
from loom.model.spec_verify import verify_drafts
from loom.request import Request
from loom.sampling import SamplingParams

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_torch_thread")]


def spec(k: int = 3, low: int = 2, high: int = 3) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k,
                       "prompt_lookup_min": low, "prompt_lookup_max": high})


def request_of(tokens: list[int]) -> Request:
    return Request("r", tokens, SamplingParams(max_tokens=8))


# -- configuration ------------------------------------------------------------------------------

def test_config_spells_vllms_keys_and_refuses_bad_ones() -> None:
    assert SpeculativeConfig.from_json('{"num_speculative_tokens": 2}').prompt_lookup_min == 5
    one = SpeculativeConfig.from_json('{"num_speculative_tokens": 2, "prompt_lookup_max": 3}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)
    for bad, message in [('{"method": "eagle"}', "'ngram'"),
                         ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                         ('{"prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup"),
                         ('{"num_draft": 2}', "unknown keys"), ("[1]", "JSON object"),
                         ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(bad)
    with pytest.raises(ValueError, match="async_scheduling"):
        SchedulerConfig(speculative_config=spec(), async_scheduling=True)


# -- the proposer -------------------------------------------------------------------------------

def test_proposes_what_followed_the_longest_earlier_match() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1,
                                               prompt_lookup_max=3))
    # "7 8 9" occurred before, followed by 1 2 3; "9" alone last occurred before 5.
    request = request_of([7, 8, 9, 1, 2, 3, 4, 9, 5, 6, 7, 8, 9])
    assert proposer.propose(request, 3) == [1, 2, 3]
    assert proposer.propose(request, 2) == [1, 2]
    request.output_token_ids += [42]  # "9 42" never occurred: no match of any size
    assert proposer.propose(request, 3) == []
    request.output_token_ids += [4]  # "4": the earlier 4 was followed by 9 5 6
    assert proposer.propose(request, 3) == [9, 5, 6]


def test_proposals_stop_at_the_end_of_the_context() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=2,
                                               prompt_lookup_max=2))
    assert proposer.propose(request_of([3, 4, 5, 3, 4]), 4) == [5, 3, 4]


def test_drafts_are_as_many_as_the_acceptance_makes_worth_a_row() -> None:
    assert drafts_worth_proposing(1.0, 4) == 4
    assert drafts_worth_proposing(0.9, 4) == 4  # 0.9^4 = 0.66: the fourth is still worth it
    assert drafts_worth_proposing(0.5, 4) == 2  # 0.5^3 = 0.125 < DRAFT_ROW_COST
    assert drafts_worth_proposing(0.3, 4) == 1
    assert drafts_worth_proposing(DRAFT_ROW_COST, 4) == 0


def test_a_request_whose_drafts_keep_failing_drafts_fewer_then_pauses_longer() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                               prompt_lookup_max=1))
    request = request_of([1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1])
    proposer.new_step()
    sizes, paused_steps = [], []
    for _ in range(7):
        drafts = proposer.propose(request, 4)
        sizes.append(len(drafts))
        proposer.record("r", len(drafts), 0)  # every draft rejected
        paused = 0
        while True:
            proposer.new_step()
            if proposer.propose(request, 4):
                break
            paused += 1
        paused_steps.append(paused)
    assert sizes[:3] == [4, 2, 1]  # acceptance 1 -> 0.5 -> 0.25: fewer drafts, no pause yet
    assert paused_steps[:2] == [0, 0]
    assert 0 < paused_steps[2] < paused_steps[3] < paused_steps[4] < paused_steps[5]
    assert sizes[3:] == [1, 1, 1, 1]  # after a pause, one draft probes
    proposer.record("r", 1, 1)  # a kept probe: more drafts again, no pause
    proposer.new_step()
    assert len(proposer.propose(request, 4)) > 1


def test_a_new_request_starts_from_the_traffics_acceptance() -> None:
    proposer = NgramProposer(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                               prompt_lookup_max=1))
    tokens = [1, 2, 3, 4, 5, 1]
    proposer.new_step()
    assert len(proposer.propose(Request("first", tokens, SamplingParams(max_tokens=8)), 4)) == 4
    for i in range(40):  # many requests' drafts rejected: traffic that does not copy
        other = Request(f"other-{i}", tokens, SamplingParams(max_tokens=8))
        proposer.record(other.request_id, len(proposer.propose(other, 4)), 0)
    assert proposer.traffic_acceptance < DRAFT_ROW_COST
    late = Request("late", tokens, SamplingParams(max_tokens=8))
    assert len(proposer.propose(late, 4)) == 1  # a probe, not four rows


# -- verification keeps the model's distribution ------------------------------------------------

def test_greedy_verification_keeps_the_argmax_run() -> None:
    logits = torch.full((4, 10), -5.0)
    for row, token in enumerate([3, 4, 9, 1]):
        logits[row, token] = 5.0
    assert verify_drafts(logits, [3, 4, 5], SamplingParams(temperature=0), None) == ([3, 4], 9)
    assert verify_drafts(logits, [3, 4, 9], SamplingParams(temperature=0), None) == ([3, 4, 9], 1)


def test_sampled_tokens_keep_their_distribution_with_drafts() -> None:
    """The first token after verification is distributed as the model's row 0 whatever the
    draft; given that the draft was kept, the next one is distributed as row 1."""
    torch.manual_seed(0)
    logits = torch.randn(2, 6) * 1.5
    params = SamplingParams(temperature=0.8, top_k=5)
    probs = [torch.softmax(_top5(logits[i]) / 0.8, dim=-1) for i in range(2)]
    generator = torch.Generator().manual_seed(1)
    trials, draft = 5000, 2
    first, second = Counter(), Counter()
    for _ in range(trials):
        accepted, token = verify_drafts(logits, [draft], params, generator)
        tokens = [*accepted, token]
        first[tokens[0]] += 1
        if accepted:
            second[tokens[1]] += 1
    assert _chi_square(first, probs[0], trials) < 25.0  # 5 dof: p < 1e-4 if it fails
    assert _chi_square(second, probs[1], sum(second.values())) < 25.0
    assert abs(sum(second.values()) / trials - float(probs[0][draft])) < 0.03


def _top5(row: torch.Tensor) -> torch.Tensor:
    keep = row.topk(5).indices
    masked = torch.full_like(row, float("-inf"))
    masked[keep] = row[keep]
    return masked


def _chi_square(counts: Counter, probs: torch.Tensor, total: int) -> float:
    stat = 0.0
    for token, p in enumerate(probs.tolist()):
        expected = p * total
        if expected > 0:
            stat += (counts[token] - expected) ** 2 / expected
        else:
            assert counts[token] == 0, f"token {token} has no probability but was drawn"
    return stat


# -- the engine loop ---------------------------------------------------------------------------

def test_the_engine_accepts_and_rejects_drafts_and_keeps_exact_outputs() -> None:
    """On a model that mostly copies its context, drafts are often right and sometimes wrong;
    either way every request's tokens are exactly the model's, in fewer steps than tokens."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                             speculative_config=spec(k=4, low=1, high=3))
    engine = make_engine(config, num_blocks=64, block_size=4)
    rng = random.Random(3)
    prompts = {f"r{i}": [rng.randrange(1000) for _ in range(12)] for i in range(3)}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=40, ignore_eos=True))
    finished, steps = {}, 0
    while engine.has_unfinished_requests():
        outputs, _ = engine.step()
        steps += 1
        finished.update((o.request_id, o) for o in outputs if o.finished)
    for request_id, prompt in prompts.items():
        assert finished[request_id].outputs[0].token_ids == expected_output(prompt, 40,
                                                                             copying=True)
    metrics = engine.metrics.snapshot()
    drafted = metrics["loom:spec_decode_num_draft_tokens_total"]
    accepted = metrics["loom:spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < drafted
    assert steps < 40  # one prefill step, then more than one token a step on average
    assert metrics["loom:generation_tokens_total"] == 3 * 40
    assert engine.kv_cache.pool.usage == 0.0


def test_the_stats_line_reports_the_draft_acceptance_rate(caplog) -> None:
    config = SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4,
                             speculative_config=spec(k=4, low=1, high=3))
    engine = make_engine(config, num_blocks=64, block_size=4)
    engine.metrics.log_interval_s = 0.0
    engine.add_request("r", list(range(20, 32)), SamplingParams(max_tokens=30, ignore_eos=True))
    with caplog.at_level("INFO", logger="loom.stats"):
        while engine.has_unfinished_requests():
            engine.step()
    rates = [r.getMessage() for r in caplog.records if "Draft acceptance rate" in r.getMessage()]
    assert rates and any("Draft acceptance rate: 0.0%" not in line for line in rates)
