"""Synthetic workloads: request classes with length distributions, clustered arrivals,
client cancellations and multi-turn sessions, drawn into a trace from a seed. The header
states every distribution, so the file's sha256 covers what it was drawn from.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Literal

from loom.config import option
from loom.workload.tokens import PromptSynth
from loom.workload.trace import Trace, TraceRequest, header


@dataclass(frozen=True)
class LengthDist:
    """A token-length distribution, as stated in the trace header.

    uniform: integers in [low, high]; normal: N(mean, std) rounded, redrawn until it lies in
    [low, high] (truncated, so no pile-up at the bounds); fixed: always `low`.
    """

    kind: Literal["uniform", "normal", "fixed"]
    low: int
    high: int
    mean: float | None = None
    std: float | None = None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        while True:
            value = round(rng.gauss(self.mean, self.std))
            if self.low <= value <= self.high:
                return value

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class ClassSpec:
    """One request class: prompt and output lengths, and a prefix every request shares."""

    prompt_len: LengthDist
    output_len: LengthDist
    shared_prefix_len: int = 0  # tokens before the drawn prompt, identical across the class

    def to_json(self) -> dict[str, Any]:
        return {"prompt_len": self.prompt_len.to_json(), "output_len": self.output_len.to_json(),
                "shared_prefix_len": self.shared_prefix_len}


# Three request classes: short chats, long prompts, RAG. rag's prompt_len is the question
# after the 480-token shared prefix (30 blocks of 16: whole KV blocks a server can reuse).
CLASSES: dict[str, ClassSpec] = {
    "chat": ClassSpec(LengthDist("normal", 20, 50, mean=35, std=6),
                      LengthDist("uniform", 16, 96)),
    "long": ClassSpec(LengthDist("uniform", 500, 1100), LengthDist("uniform", 32, 128)),
    "rag": ClassSpec(LengthDist("uniform", 12, 40), LengthDist("uniform", 8, 160),
                     shared_prefix_len=480),
}


@dataclass(frozen=True)
class ArrivalSpec:
    """Clustered arrivals: a Poisson process of events, each a single request or, with
    probability `burst_prob`, a burst of `burst_size` requests spread over `burst_window_s`.
    `rate` is requests (not events) per second, bursts included."""

    CLI_GROUP = "Arrivals (recorded in the trace)"

    rate: float = option(2.0,
        "recorded arrivals: mean requests/s, bursts included", flag="--arrival-rate")
    burst_prob: float = option(0.1,
        "chance that an arrival is a burst")
    burst_size: tuple[int, int] = option((4, 12),
        "requests in a burst, LOW-HIGH", parse=lambda text: _range(text, int))
    burst_window_s: float = option(0.5,
        "seconds a burst is spread over", flag="--burst-window")

    def __post_init__(self) -> None:
        """Refuse what would divide by zero, loop for ever or write negative times."""
        if not 0 < self.rate < math.inf:
            raise ValueError(f"--arrival-rate must be > 0, got {self.rate:g}")
        if not 0 <= self.burst_prob <= 1:
            raise ValueError(f"--burst-prob must be from 0 to 1, got {self.burst_prob:g}")
        if self.burst_size[0] < 1:
            raise ValueError(f"--burst-size must be >= 1, got {self.burst_size[0]}")
        if not 0 <= self.burst_window_s < math.inf:
            raise ValueError(f"--burst-window must be >= 0 s, got {self.burst_window_s:g}")

    def times(self, n: int, rng: random.Random) -> list[float]:
        mean_event = 1 + self.burst_prob * ((self.burst_size[0] + self.burst_size[1]) / 2 - 1)
        event_rate = self.rate / mean_event
        times: list[float] = []
        t = 0.0
        while len(times) < n:
            if rng.random() < self.burst_prob:
                size = rng.randint(*self.burst_size)
                times += sorted(t + rng.uniform(0, self.burst_window_s) for _ in range(size))
            else:
                times.append(t)
            t += rng.expovariate(event_rate)
        return [round(x, 4) for x in sorted(times)[:n]]


@dataclass(frozen=True)
class CancelSpec:
    """A `fraction` of requests whose client walks away after uniform[after_s] seconds."""

    CLI_GROUP = "Cancellations (recorded in the trace)"

    fraction: float = option(0.05,
        "share of requests the client walks away from", flag="--cancel-fraction")
    after_s: tuple[float, float] = option((0.5, 5.0),
        "seconds before walking away, LOW-HIGH", flag="--cancel-after",
        parse=lambda text: _range(text, float))

    def __post_init__(self) -> None:
        if not 0 <= self.fraction <= 1:
            raise ValueError(f"--cancel-fraction must be from 0 to 1, got {self.fraction:g}")
        if not 0 <= self.after_s[0] < math.inf or not self.after_s[1] < math.inf:
            raise ValueError(f"--cancel-after must be finite seconds >= 0, got "
                             f"{self.after_s[0]:g}-{self.after_s[1]:g}")

    def draw(self, rng: random.Random) -> float | None:
        if rng.random() >= self.fraction:
            return None
        return round(rng.uniform(*self.after_s), 3)

    def to_json(self) -> dict[str, float]:
        low, high = self.after_s
        return {"fraction": self.fraction, "low_s": low, "high_s": high}


def _range(text: str, kind: type) -> tuple[Any, Any]:
    """'4-12' -> (4, 12); '3' -> (3, 3). LOW above HIGH is refused here, where the flag is
    known, rather than as an empty range at the first draw."""
    low, _, high = text.partition("-")
    try:
        pair = kind(low), kind(high or low)
    except ValueError:
        raise ValueError(f"expected LOW-HIGH, got {text!r}") from None
    if pair[0] > pair[1]:
        raise ValueError(f"LOW must not exceed HIGH, got {text!r}")
    return pair


@dataclass(frozen=True)
class SessionSpec:
    """Multi-turn chat or an agent loop: each turn's prompt is the whole conversation so far
    (every earlier prompt and answer) plus a new message; the next turn is sent `think_s`
    after the answer ends. Answers are synthetic text of the turn's output length, standing
    in for what the server will write."""

    turns: LengthDist = LengthDist("uniform", 2, 6)
    message_len: LengthDist = LengthDist("normal", 10, 60, mean=30, std=12)
    reply_len: LengthDist = LengthDist("uniform", 16, 96)
    think_s: tuple[float, float] = (1.0, 5.0)

    def to_json(self) -> dict[str, Any]:
        return {"turns": self.turns.to_json(), "message_len": self.message_len.to_json(),
                "reply_len": self.reply_len.to_json(),
                "think_s": {"low": self.think_s[0], "high": self.think_s[1]}}

    def conversation(self, sid: str, turns: int, start_s: float, synth: PromptSynth,
                     rng: random.Random) -> list[TraceRequest]:
        out: list[TraceRequest] = []
        history, t = "", start_s
        for k in range(turns):
            think = round(rng.uniform(*self.think_s), 3) if k else None
            t += think or 0.0
            prompt = history + synth.text(self.message_len.sample(rng), rng, prefix=history)
            request = TraceRequest(
                max_tokens=self.reply_len.sample(rng), prompt=prompt,
                prompt_len=synth.count(prompt), cls=SESSION, arrival_s=round(t, 4),
                id=f"{sid}-t{k}", session=sid, after=out[-1].id if out else None,
                think_s=think)
            history = prompt + synth.text(request.max_tokens, rng, prefix=prompt)
            out.append(request)
        return out


SESSION = "session"
SESSIONS = SessionSpec()


def parse_mix(text: str) -> dict[str, float]:
    """'chat=0.6,long=0.15,rag=0.25' -> weights normalised to sum to 1."""
    mix = {}
    for part in text.split(","):
        name, _, weight = part.partition("=")
        name = name.strip()
        if name not in CLASSES and name != SESSION:
            raise ValueError(f"unknown request class {name!r}; known: "
                             f"{', '.join([*CLASSES, SESSION])}")
        mix[name] = float(weight) if weight else 1.0
        if mix[name] < 0:
            raise ValueError(f"weight of {name!r} must be >= 0")
    total = sum(mix.values())
    if total <= 0:
        raise ValueError("the mix needs a positive weight")
    return {k: v / total for k, v in mix.items()}


def generate_mix(mix: dict[str, float], n: int, seed: int, synth: PromptSynth,
                 arrivals: ArrivalSpec, cancels: CancelSpec, tokenizer_name: str) -> Trace:
    """n requests of the given class mix; same seed + tokenizer -> byte-identical file. A
    session's turns take consecutive session slots of the mix; it starts at its first."""
    rng = random.Random(seed)
    prefixes = {name: synth.text(CLASSES[name].shared_prefix_len, rng)
                for name in mix if name in CLASSES and CLASSES[name].shared_prefix_len}
    times = arrivals.times(n, rng)
    names = _class_sequence(mix, n, rng)
    session_slots, skip = names.count(SESSION), 0
    requests = []
    for i, (arrival, name) in enumerate(zip(times, names)):
        if name == SESSION:
            if skip:
                skip -= 1
                continue
            turns = min(SESSIONS.turns.sample(rng), session_slots)
            session_slots, skip = session_slots - turns, turns - 1
            requests += SESSIONS.conversation(f"session-{i:05d}", turns, arrival, synth, rng)
            continue
        spec = CLASSES[name]
        prefix = prefixes.get(name, "")
        prompt = prefix + synth.text(spec.prompt_len.sample(rng), rng, prefix=prefix)
        requests.append(TraceRequest(
            max_tokens=spec.output_len.sample(rng), prompt=prompt,
            prompt_len=synth.count(prompt), cls=name, arrival_s=arrival,
            cancel_after_s=cancels.draw(rng), id=f"{name}-{i:05d}"))
    requests.sort(key=lambda r: r.arrival_s)
    made = drawn_header("mix", seed, n, tokenizer_name, arrivals, cancels)
    made["mix"] = {k: round(v, 6) for k, v in mix.items()}
    made["classes"] = {k: (CLASSES[k] if k in CLASSES else SESSIONS).to_json() for k in mix}
    return Trace(requests, made)


def _class_sequence(mix: dict[str, float], n: int, rng: random.Random) -> list[str]:
    """Exactly the mix's shares of n (largest remainders), in random order: a small trace
    should not drift from the mix it claims."""
    exact = {name: weight * n for name, weight in mix.items()}
    counts = {name: int(x) for name, x in exact.items()}
    by_remainder = sorted(exact, key=lambda name: exact[name] - counts[name], reverse=True)
    for name in by_remainder[:n - sum(counts.values())]:
        counts[name] += 1
    names = [name for name, count in counts.items() for _ in range(count)]
    rng.shuffle(names)
    return names


def drawn_header(kind: str, seed: int, n: int, tokenizer_name: str, arrivals: ArrivalSpec,
                 cancels: CancelSpec) -> dict[str, Any]:
    """The header of a trace whose arrivals and cancellations were drawn here."""
    return {**header(kind, seed, n, tokenizer_name), "arrivals": asdict(arrivals),
            "cancellations": cancels.to_json()}
