"""The engine process's output deltas (loom.engine.output_delta): the server rebuilds exactly
the cumulative outputs the engine made, whatever the interleaving of requests; what crosses
the pipe for a step does not grow with the output's length; nothing is kept once a request
finishes."""

from __future__ import annotations

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loom.engine.output_delta import DeltaDecoder, DeltaEncoder
from loom.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob

pytestmark = pytest.mark.unit


class FakeRequest:
    """A request's cumulative state as the engine keeps it: lists that grow in place."""

    def __init__(self, request_id: str, logprobs: bool, prompt_logprobs: bool) -> None:
        self.request_id = request_id
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if logprobs else None
        self.prompt_logprobs: list[TokenLogprob | None] | None = [None] if prompt_logprobs \
            else None
        self.metrics = RequestMetrics(arrival_time=1.0)

    def grow(self, tokens: int, text: str) -> None:
        for _ in range(tokens):
            token = len(self.token_ids) * 7 % 1000
            self.token_ids.append(token)
            if self.logprobs is not None:
                self.logprobs.append(TokenLogprob(token, -0.5, [(token, -0.5), (3, -1.0)]))
        if self.prompt_logprobs is not None and len(self.prompt_logprobs) < 4:
            self.prompt_logprobs.append(TokenLogprob(9, -2.0, []))
        self.text += text

    def output(self, finished: bool) -> RequestOutput:
        completion = CompletionOutput(0, self.text, list(self.token_ids),
                                      "stop" if finished else None, None, self.logprobs)
        return RequestOutput(self.request_id, "a prompt", [1, 2, 3], [completion], finished,
                             self.prompt_logprobs, num_cached_tokens=2, metrics=self.metrics)


def as_sent(output: RequestOutput) -> RequestOutput:
    """What the server gets of an output: a snapshot (the engine's lists go on growing)."""
    return pickle.loads(pickle.dumps(output))


steps = st.lists(st.tuples(st.integers(0, 2),           # which request
                           st.integers(0, 3),           # tokens it adds
                           st.text(max_size=3),          # text it adds
                           st.booleans()),               # its text is rewritten (not extended)
                 min_size=1, max_size=40)


@given(steps=steps, flags=st.lists(st.booleans(), min_size=6, max_size=6))
@settings(max_examples=60, deadline=None)
def test_the_server_rebuilds_every_output_the_engine_made(steps, flags) -> None:
    requests = [FakeRequest(f"r{i}", flags[2 * i], flags[2 * i + 1]) for i in range(3)]
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    for which, tokens, text, rewrite in steps:
        request = requests[which]
        request.grow(tokens, text)
        if rewrite:
            request.text = "rewritten " + request.text[1:]
        output = request.output(finished=False)
        expected = copy.deepcopy(output)
        rebuilt = decoder.decode(as_sent(encoder.encode(output)))
        assert rebuilt == expected
    for request in requests:
        expected = request.output(finished=True)
        assert decoder.decode(as_sent(encoder.encode(expected))) == expected
    assert encoder._sent == {} and decoder._received == {}  # nothing outlives its request


def test_a_steps_delta_does_not_grow_with_the_output() -> None:
    """Cumulative outputs pickled whole grow with every token (with logprobs, by their
    objects); the delta of step 500 is the size of step 5's."""
    request = FakeRequest("r", logprobs=True, prompt_logprobs=False)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    sizes = {}
    for step in range(1, 501):
        request.grow(1, " word")
        output = request.output(finished=False)
        delta = pickle.dumps(encoder.encode(output))
        decoder.decode(pickle.loads(delta))
        if step in (5, 500):
            sizes[step] = (len(delta), len(pickle.dumps(output)))
    assert sizes[500][0] < 1.2 * sizes[5][0]
    assert sizes[500][1] > 50 * sizes[500][0]  # what a cumulative output would have cost
    final = decoder.decode(pickle.loads(pickle.dumps(encoder.encode(request.output(True)))))
    assert len(final.outputs[0].token_ids) == len(final.outputs[0].logprobs) == 500
    assert final.outputs[0].text == " word" * 500


def test_outputs_handed_out_earlier_keep_their_token_ids() -> None:
    """A reader may keep an output and compare it with the next (streaming deltas)."""
    request = FakeRequest("r", logprobs=False, prompt_logprobs=False)
    encoder, decoder = DeltaEncoder(), DeltaDecoder()
    request.grow(2, "ab")
    first = decoder.decode(as_sent(encoder.encode(request.output(False))))
    request.grow(3, "cde")
    second = decoder.decode(as_sent(encoder.encode(request.output(False))))
    assert len(first.outputs[0].token_ids) == 2 and first.outputs[0].text == "ab"
    assert len(second.outputs[0].token_ids) == 5 and second.outputs[0].text == "abcde"
