"""Arrival generation: Poisson and gamma at an offered rate, the trace's own arrivals."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.workload.arrivals import gaps, schedule
from loom.workload.trace import TraceRequest

pytestmark = pytest.mark.unit


def _requests(n: int, arrivals: list[float] | None = None) -> list[TraceRequest]:
    return [TraceRequest(max_tokens=1, prompt="x", id=str(i),
                         arrival_s=arrivals[i] if arrivals else None) for i in range(n)]


def test_poisson_has_the_offered_mean_rate_and_exponential_spread() -> None:
    sample = list(itertools.islice(gaps(4.0, 1.0, random.Random(0)), 20000))
    assert statistics.mean(sample) == pytest.approx(0.25, rel=0.03)
    cv2 = statistics.pvariance(sample) / statistics.mean(sample) ** 2
    assert cv2 == pytest.approx(1.0, rel=0.08)  # exponential gaps: CV^2 = 1


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_keeps_the_rate_and_sets_the_spread(burstiness: float) -> None:
    sample = list(itertools.islice(gaps(2.0, burstiness, random.Random(1)), 20000))
    assert statistics.mean(sample) == pytest.approx(0.5, rel=0.05)
    cv2 = statistics.pvariance(sample) / statistics.mean(sample) ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.1)  # gamma(k): CV^2 = 1/k


@settings(max_examples=30, deadline=None)
@given(rate=st.floats(0.1, 100), burstiness=st.floats(0.1, 10), seed=st.integers(0, 10**6))
def test_schedule_is_ordered_seeded_and_covers_the_trace(rate: float, burstiness: float,
                                                         seed: int) -> None:
    requests = _requests(20)
    first = list(schedule(requests, rate, burstiness, seed))
    assert [r for _, r in first] == requests
    offsets = [t for t, _ in first]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    assert first == list(schedule(requests, rate, burstiness, seed))


def test_unlimited_rate_sends_everything_at_once() -> None:
    assert [t for t, _ in schedule(_requests(5), math.inf)] == [0.0] * 5


def test_trace_rate_replays_recorded_arrivals_and_cycles_at_the_same_rate() -> None:
    requests = _requests(3, [10.0, 10.5, 12.0])
    once = [t for t, _ in schedule(requests, "trace")]
    assert once == [0.0, 0.5, 2.0]
    cycled = [t for t, _ in itertools.islice(schedule(requests, "trace", cycle=True), 6)]
    assert cycled == [0.0, 0.5, 2.0, 3.0, 3.5, 5.0]  # period = span + mean gap


def test_trace_rate_needs_arrivals() -> None:
    with pytest.raises(ValueError, match="arrival_s"):
        list(schedule(_requests(2), "trace"))
