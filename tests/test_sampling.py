"""Sampler and stop-string detokenizer, without the model."""

from __future__ import annotations

import math

import pytest
import torch

from loom.engine.detokenizer import IncrementalDetokenizer
from loom.model.logits import NUCLEUS_CANDIDATES
from loom.model.sampler import (
    Sampler,
    apply_token_bitmask,
    apply_top_k_top_p,
    generator_seed,
    row_argmax,
)
from loom.sampling import MAX_STOPS, SamplingParams, SamplingParamsError, valid_unicode

pytestmark = pytest.mark.unit


def test_top_k_and_top_p_keep_only_the_allowed_tokens() -> None:
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]))
    masked = apply_top_k_top_p(logits, top_k=[2, -1], top_p=[1.0, 0.7])
    assert torch.isfinite(masked[0]).tolist() == [True, True, False, False]
    # top_p=0.7: 0.5 alone is below 0.7, 0.5 + 0.3 reaches it, so two tokens stay
    assert torch.isfinite(masked[1]).tolist() == [True, True, False, False]


def test_row_argmax_is_torchs_first_largest_index() -> None:
    logits = torch.randn(6, 1000)
    logits[1, [3, 700]] = 50.0  # a tie: the first index, as torch's argmax
    logits[2, :] = 1.0
    assert row_argmax(logits).tolist() == logits.argmax(dim=-1).tolist()
    assert row_argmax(logits)[1:3].tolist() == [3, 0]
    rows = logits[::2]  # not contiguous
    assert row_argmax(rows).tolist() == rows.argmax(dim=-1).tolist()
    assert row_argmax(logits.to(torch.bfloat16)).tolist() == \
        logits.to(torch.bfloat16).argmax(dim=-1).tolist()


def test_rows_are_sampled_with_their_own_parameters() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [1.0, 1.0, 1.0]])
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=1),
              SamplingParams(temperature=1.0, seed=3)]
    gens = [None, None, torch.Generator().manual_seed(3)]
    assert Sampler()(logits, params, gens)[:2].tolist() == [1, 2]


@pytest.mark.parametrize("params", [SamplingParams(temperature=1e-40),
                                    SamplingParams(temperature=1e-6, seed=1),
                                    SamplingParams(top_p=1e-320),
                                    SamplingParams(top_p=1e-45, top_k=3)])
def test_vanishing_temperature_or_top_p_picks_the_likeliest_token(params) -> None:
    """Values that pass the range checks but round to 0 in float32 (or overflow the logits
    divided by them) are the limit they tend to: the likeliest token, never a NaN's pick."""
    logits = torch.tensor([[0.1, 3.0, 2.9, -1.0]] * 50)
    gens = [torch.Generator().manual_seed(i) for i in range(50)]
    assert Sampler()(logits, [params] * 50, gens).tolist() == [1] * 50


def test_penalties_and_bias_adjust_only_the_rows_that_ask() -> None:
    from loom.model.sampler import adjust_logits

    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]] * 3)
    params = [SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, logit_bias={0: -3.0}),
              SamplingParams(repetition_penalty=2.0), SamplingParams()]
    got = adjust_logits(logits, params, [[1, 1, 3], [2], [1]], [[], [1], [0]], [(), (), ()])
    assert got.tolist() == [[-2.0, -0.5, -1.0, -1.0],  # 2 - (2 x 1 + 0.5); 0.5 - 1.5
                            [1.0, 1.0, -2.0, 0.5],  # seen in prompt or output: / or x 2
                            [1.0, 2.0, -1.0, 0.5]]
    banned = adjust_logits(logits, [SamplingParams()] * 3, [[]] * 3, [[]] * 3, [(), (1, 3), ()])
    assert banned[1].tolist() == [1.0, float("-inf"), -1.0, float("-inf")]
    assert torch.equal(banned[::2], logits[::2])
    assert logits[0].tolist() == [1.0, 2.0, -1.0, 0.5]  # a copy: logprobs read the model's


def test_seeded_draws_follow_the_distribution_and_repeat() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    params = [SamplingParams(temperature=1.0, seed=1)]
    gen = torch.Generator().manual_seed(1)
    draws = [Sampler()(logits, params, [gen]).item() for _ in range(3000)]
    share = [draws.count(i) / len(draws) for i in range(3)]
    assert share == pytest.approx([0.7, 0.2, 0.1], abs=0.03)
    gen2 = torch.Generator().manual_seed(1)
    assert [Sampler()(logits, params, [gen2]).item() for _ in range(3000)] == draws


def test_unseeded_rows_of_one_batch_follow_their_distributions() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 0.1, 0.9]])
    logits = torch.log(probs).repeat(2000, 1)  # zero-probability tokens: -inf logits
    params = [SamplingParams(temperature=1.0)] * len(logits)
    draws = Sampler()(logits, params, [None] * len(logits)).view(2000, 2)
    for row, expected in enumerate(probs.tolist()):
        share = [(draws[:, row] == i).float().mean().item() for i in range(4)]
        assert share == pytest.approx(expected, abs=0.04)
        assert all(share[i] == 0 for i in range(4) if expected[i] == 0)


@pytest.mark.parametrize("kwargs, field", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=50), "logprobs"),
    (dict(stop=[""]), "stop"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=float("nan")), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={1: 101.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
])
def test_invalid_parameters_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(SamplingParamsError, match=field) as error:
        SamplingParams(**kwargs)
    assert error.value.field == field


@pytest.mark.parametrize("kwargs, field", [
    (dict(seed=2**64), "seed"), (dict(seed=-(2**63) - 1), "seed"), (dict(seed=True), "seed"),
    (dict(top_k=2**63), "top_k"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=math.nan), "temperature"), (dict(top_p=math.nan), "top_p"),
    (dict(max_tokens=True), "max_tokens"), (dict(max_tokens=2.0), "max_tokens"),
    (dict(stop=""), "stop"), (dict(stop=["\ud800"]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=[False]), "stop_token_ids"),
])
def test_values_that_once_reached_the_model_are_refused(kwargs: dict, field: str) -> None:
    """Each of these failed inside a model step (a seed torch cannot take, a top-k tensor
    that overflows) or slipped through as another type."""
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**kwargs)
    assert error.value.field == field


def test_stop_lists_are_capped_where_each_token_is_checked_against_them() -> None:
    """Every generated token is checked against each stop string and stop token id on the
    step loop all requests share: a list long enough to slow everyone is a 400 naming it,
    while the longest allowed list is taken."""
    SamplingParams(stop=[f"s{i}" for i in range(MAX_STOPS)],
                   stop_token_ids=list(range(MAX_STOPS)))
    for field, too_many in (("stop", [f"s{i}" for i in range(MAX_STOPS + 1)]),
                            ("stop_token_ids", list(range(MAX_STOPS + 1)))):
        with pytest.raises(SamplingParamsError, match=f"at most {MAX_STOPS}") as error:
            SamplingParams(**{field: too_many})
        assert error.value.field == field


def test_seeds_wider_than_32_bits_draw_their_own_numbers() -> None:
    """torch's CPU generator keeps a seed's low 32 bits: 1 and 2**32 + 1 (or -1 and
    2**32 - 1) drew the same numbers. 32-bit seeds stay as they were; -1 and 2**64 - 1 are
    one 64-bit value."""
    assert [generator_seed(s) for s in (0, 1, 2**32 - 1)] == [0, 1, 2**32 - 1]
    wide = [1, 2**32 + 1, 2**33 + 1, -1, 2**32 - 1, 2**63 - 1, -(2**63), 2**64 - 2]
    assert len({generator_seed(s) for s in wide}) == len(wide)
    assert generator_seed(-1) == generator_seed(2**64 - 1)
    assert all(0 <= generator_seed(s) < 2**32 for s in wide)
    draws = {tuple(torch.rand(4, generator=torch.Generator().manual_seed(generator_seed(s))
                              ).tolist()) for s in wide}
    assert len(draws) == len(wide)


def test_the_widest_valid_values_are_taken() -> None:
    SamplingParams(seed=2**64 - 1, top_k=2**31 - 1, temperature=1e300, stop_token_ids=[0])
    SamplingParams(seed=-(2**63))


def test_vocabulary_checks_name_the_field() -> None:
    params = SamplingParams(top_k=1000, stop_token_ids=[5, 99])
    params.check_vocab(1000)
    with pytest.raises(SamplingParamsError) as error:
        params.check_vocab(99)
    assert error.value.field == "top_k"
    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(stop_token_ids=[99]).check_vocab(99)
    assert error.value.field == "stop_token_ids"


def test_valid_unicode_refuses_lone_surrogates() -> None:
    assert valid_unicode("héllo \U0001f600") and not valid_unicode("a\ud800b")


class CharTokenizer:
    """One character per token id: enough to drive the detokenizer's text logic."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def feed(text: str, stop: list[str], min_tokens: int = 0) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(CharTokenizer(), [ord(">")], stop, min_tokens)
    for ch in text:
        detok.push(ord(ch))
        if detok.stopped_on:
            break
    return detok


def test_stop_string_is_cut_and_partial_matches_are_held_back() -> None:
    detok = feed("hello END world", ["END"])
    assert detok.stopped_on == "END" and detok.text == "hello "
    partial = feed("hello EN", ["END"])
    assert partial.stopped_on is None
    assert partial.visible_text(finished=False) == "hello "  # "EN" might become "END"
    assert partial.visible_text(finished=True) == "hello EN"


def test_stop_strings_end_the_answer_only_from_min_tokens_on() -> None:
    """As stop tokens and EOS: the first min_tokens - 1 tokens never stop (vLLM's rule)."""
    assert feed("a. b. c.", ["."], min_tokens=3).text == "a. b"
    assert feed("a. b. c.", ["."], min_tokens=2).text == "a"  # the 2nd token may stop
    assert feed("a. b. c.", ["."]).text == "a"
    assert feed("a. b", ["."], min_tokens=10).stopped_on is None


def test_earliest_stop_string_wins() -> None:
    detok = feed("abcdef", ["cdef", "bc"])
    assert detok.stopped_on == "bc" and detok.text == "a"


def test_the_grammar_bitmask_leaves_only_allowed_tokens() -> None:
    """Bit j of word w allows token 32 w + j; logits past the mask's width (a vocabulary
    padded beyond the tokenizer's) are never allowed; allowed logits keep their values."""
    import numpy as np

    bitmask = np.zeros((2, 2), dtype=np.int32)
    bitmask[0, 0] = 0b101  # tokens 0 and 2
    bitmask[1, 1] = -2**31  # token 63 (the sign bit)
    logits = torch.arange(140, dtype=torch.float32).view(2, 70)
    masked = apply_token_bitmask(logits, bitmask)
    finite = [torch.isfinite(row).nonzero().flatten().tolist() for row in masked]
    assert finite == [[0, 2], [63]]
    assert masked[0, 2] == logits[0, 2] and masked[1, 63] == logits[1, 63]
    greedy = Sampler()(masked, [SamplingParams(temperature=0)] * 2, [None, None])
    assert greedy.tolist() == [2, 63]


def _kept_by_full_sort(logits: torch.Tensor, top_k: list[int], top_p: list[float]
                       ) -> list[set[int]]:
    """The kept sets by the definition, one row at a time over its whole sorted row."""
    kept = []
    for row, k, p in zip(logits, top_k, top_p):
        order = row.sort(descending=True).indices.tolist()
        order = order[:k] if k > 0 else order
        probs = row[order].softmax(dim=-1).tolist()
        keep, before = set(), 0.0
        for i, (token, prob) in enumerate(zip(order, probs)):
            if i > 0 and before >= p:
                break
            keep.add(token)
            before += prob
        kept.append(keep)
    return kept


@pytest.mark.parametrize("scale", [0.5, 3.0, 20.0])  # 0.5: nuclei wider than the candidates
def test_top_k_top_p_keep_what_a_full_sort_keeps(scale: float) -> None:
    """Deciding among the likeliest NUCLEUS_CANDIDATES tokens, or sorting the whole batch when
    a row's nucleus reaches past them, keeps each row's set as sorting its whole row does."""
    generator = torch.Generator().manual_seed(int(scale * 10))
    logits = torch.randn(6, 5000, generator=generator) * scale
    top_k = [-1, 40, -1, 700, 3, -1]
    top_p = [0.9, 0.95, 0.5, 1.0, 0.2, 0.99]
    masked = apply_top_k_top_p(logits, top_k, top_p)
    kept = [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in masked]
    expected = _kept_by_full_sort(logits, top_k, top_p)
    for got, want in zip(kept, expected):
        assert len(got ^ want) <= 1, (len(got), len(want))  # one float32 boundary at most
    assert max(map(len, expected)) > NUCLEUS_CANDIDATES or scale > 0.5  # the fallback ran
    assert masked[torch.isfinite(masked)].tolist() == logits[torch.isfinite(masked)].tolist()


def test_sampled_tokens_stay_in_their_rows_kept_sets() -> None:
    """A batch mixing rows with and without limits: each drawn token is one its row keeps."""
    generator = torch.Generator().manual_seed(5)
    logits = torch.randn(8, 3000, generator=generator) * 4
    params = [SamplingParams(temperature=0.7, top_p=0.5), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, top_k=2)] * 2
    kept = _kept_by_full_sort(logits / torch.tensor([[max(p.temperature, 1e-9)] for p in params]),
                              [p.top_k for p in params], [p.top_p for p in params])
    for trial in range(20):
        gens = [torch.Generator().manual_seed(trial * 8 + i) for i in range(8)]
        tokens = Sampler()(logits, params, gens).tolist()
        for i in (0, 3, 4, 7):
            assert tokens[i] in kept[i]
        assert tokens[2] == int(logits[2].argmax()) and tokens[6] == int(logits[6].argmax())
