"""Request traces: the JSONL format, reading and hashing it, generating a three-class
mix, and importing ShareGPT conversations.

Format (one JSON object per line):

    {"header": {...}}                       optional first line: how the trace was made
    {"id": "chat-00000", "class": "chat", "prompt": "...", "prompt_len": 35,
     "max_tokens": 64, "arrival_s": 0.0, "cancel_after_s": 2.5, "priority": 0}

A request needs `prompt` (text) or `prompt_len` (tokens; text is synthesised at replay) and
`max_tokens` (or `output_len`); the rest is optional. `arrival_s` is replayed as recorded with
`--rate trace`; `cancel_after_s` makes the client close the stream after that many seconds.
The header sits inside the file (not in a sidecar) so the file's sha256, recorded in every
result, covers the distributions it was drawn from too.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from loom.bench.tokens import PromptSynth
from loom.config import flag_help

TRACE_VERSION = 1


@dataclass
class TraceRequest:
    """One request. `tenant` names who sent it (fairness per tenant); a session's turns name
    the turn before them in `after`: the client sends a turn `think_s` seconds after the
    previous one's answer ends, as a user or an agent would."""

    max_tokens: int
    prompt: str | None = None
    prompt_len: int | None = None
    cls: str = "default"
    arrival_s: float | None = None
    cancel_after_s: float | None = None
    priority: int | None = None
    id: str | None = None
    tenant: str | None = None
    session: str | None = None
    after: str | None = None
    think_s: float | None = None
    temperature: float | None = None  # None: the server's default sampling

    @classmethod
    def from_json(cls, obj: dict[str, Any], where: str) -> TraceRequest:
        """A request from one trace line; a bad field is named with `where` (file:line), so
        a hand-edited trace fails at load, not as a 400 in the middle of a replay."""
        max_tokens = obj.get("max_tokens", obj.get("output_len"))
        if not _positive_int(max_tokens):
            raise ValueError(f"{where}: max_tokens (or output_len) must be a positive integer, "
                             f"got {max_tokens!r}")
        prompt, prompt_len = obj.get("prompt"), obj.get("prompt_len")
        if prompt is not None and (not isinstance(prompt, str) or not prompt):
            raise ValueError(f"{where}: prompt must be non-empty text, got {prompt!r}")
        if prompt_len is not None and not _positive_int(prompt_len):
            raise ValueError(f"{where}: prompt_len must be a positive integer, got "
                             f"{prompt_len!r}")
        if prompt is None and prompt_len is None:
            raise ValueError(f"{where}: needs prompt (text) or prompt_len (positive integer)")
        for key in ("arrival_s", "cancel_after_s", "think_s"):
            value = obj.get(key)
            if value is not None and not (_number(value) and 0 <= value < math.inf):
                raise ValueError(f"{where}: {key} must be a finite number >= 0, got {value!r}")
        temperature = obj.get("temperature")
        if temperature is not None and not (_number(temperature) and 0 <= temperature <= 2):
            raise ValueError(f"{where}: temperature must be a number from 0 to 2")
        priority = obj.get("priority")
        if priority is not None and (not isinstance(priority, int) or isinstance(priority, bool)):
            raise ValueError(f"{where}: priority must be an integer, got {priority!r}")
        for key in ("id", "tenant", "session", "after"):
            if obj.get(key) is not None and not isinstance(obj[key], str):
                raise ValueError(f"{where}: {key} must be a string, got {obj[key]!r}")
        return cls(max_tokens=max_tokens, prompt=prompt, prompt_len=prompt_len,
                   cls=str(obj.get("class", "default")),
                   arrival_s=obj.get("arrival_s"), cancel_after_s=obj.get("cancel_after_s"),
                   priority=priority, id=obj.get("id"), tenant=obj.get("tenant"),
                   session=obj.get("session"), after=obj.get("after"),
                   think_s=obj.get("think_s"), temperature=temperature)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "class": self.cls, "prompt": self.prompt,
                               "prompt_len": self.prompt_len, "max_tokens": self.max_tokens,
                               "arrival_s": self.arrival_s, "cancel_after_s": self.cancel_after_s,
                               "priority": self.priority, "tenant": self.tenant,
                               "session": self.session, "after": self.after,
                               "think_s": self.think_s, "temperature": self.temperature}
        return {k: v for k, v in out.items() if v is not None}


@dataclass
class Trace:
    requests: list[TraceRequest]
    header: dict[str, Any] = field(default_factory=dict)
    sha256: str | None = None
    path: str | None = None

    def describe(self) -> dict[str, Any]:
        """What a result records about the trace it replayed."""
        return {"path": self.path, "sha256": self.sha256, "num_requests": len(self.requests),
                "header": self.header}


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace; every error names the file, the line and the field."""
    data = Path(path).read_bytes()
    header: dict[str, Any] = {}
    requests = []
    seen: dict[str, int] = {}
    for number, line in enumerate(_decode(data, path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object (a request), got "
                             f"{type(obj).__name__}")
        if "header" in obj:
            if not isinstance(obj["header"], dict):
                raise ValueError(f"{path}:{number}: the trace header must be a JSON object, "
                                 f"got {obj['header']!r}")
            header = obj["header"]
            continue
        request = TraceRequest.from_json(obj, f"{path}:{number}")
        if request.id is not None:
            if request.id in seen:  # sessions and results refer to requests by id
                raise ValueError(f"{path}:{number}: id {request.id!r} repeats line "
                                 f"{seen[request.id]}")
            seen[request.id] = number
        requests.append(request)
    if not requests:
        raise ValueError(f"{path}: no requests")
    return Trace(requests, header, hashlib.sha256(data).hexdigest(), str(path))


def _decode(data: bytes, path: str | Path) -> str:
    """The file as UTF-8 text, or an error naming the line that is not."""
    try:
        return data.decode()
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {data[e.start]:#04x})") from None


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    """A JSON number: not a bool (True is an int to Python), not NaN."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def write_trace(trace: Trace, path: str | Path) -> str:
    """Write header + requests as JSONL; returns the file's sha256."""
    lines = [json.dumps({"header": trace.header})] if trace.header else []
    lines += [json.dumps(r.to_json(), ensure_ascii=False) for r in trace.requests]
    data = ("\n".join(lines) + "\n").encode()
    Path(path).write_bytes(data)
    trace.sha256, trace.path = hashlib.sha256(data).hexdigest(), str(path)
    return trace.sha256


def fill_prompts(trace: Trace, synth: PromptSynth, seed: int = 0) -> None:
    """Give requests that only state `prompt_len` a synthetic prompt of that many tokens."""
    rng = random.Random(seed)
    for r in trace.requests:
        if r.prompt is None:
            r.prompt = synth.text(r.prompt_len, rng)


# -- generation --------------------------------------------------------------------------------

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

    rate: float = field(default=2.0, metadata=flag_help(
        "recorded arrivals: mean requests/s, bursts included", flag="--arrival-rate"))
    burst_prob: float = field(default=0.1, metadata=flag_help(
        "chance that an arrival is a burst"))
    burst_size: tuple[int, int] = field(default=(4, 12), metadata=flag_help(
        "requests in a burst, LOW-HIGH", parse=lambda text: _range(text, int)))
    burst_window_s: float = field(default=0.5, metadata=flag_help(
        "seconds a burst is spread over", flag="--burst-window"))

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

    fraction: float = field(default=0.05, metadata=flag_help(
        "share of requests the client walks away from", flag="--cancel-fraction"))
    after_s: tuple[float, float] = field(default=(0.5, 5.0), metadata=flag_help(
        "seconds before walking away, LOW-HIGH", flag="--cancel-after",
        parse=lambda text: _range(text, float)))

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
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected LOW-HIGH, got {text!r}") from e
    if pair[0] > pair[1]:
        raise argparse.ArgumentTypeError(f"LOW must not exceed HIGH, got {text!r}")
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
    header = _header("mix", seed, n, tokenizer_name, arrivals, cancels)
    header["mix"] = {k: round(v, 6) for k, v in mix.items()}
    header["classes"] = {k: (CLASSES[k] if k in CLASSES else SESSIONS).to_json() for k in mix}
    return Trace(requests, header)


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


def import_sharegpt(path: str | Path, n: int | None, seed: int, synth: PromptSynth,
                    arrivals: ArrivalSpec, cancels: CancelSpec, tokenizer_name: str,
                    max_prompt_len: int = 1024, max_total_len: int = 2048) -> Trace:
    """ShareGPT-style conversations -> trace: the first user turn is the prompt, the token
    count of the reply after it the output length. Filters as `vllm bench serve` does:
    prompt and reply >= 4 tokens, prompt <= max_prompt_len, both <= max_total_len."""
    rng = random.Random(seed)
    pairs = [p for p in (_first_exchange(c) for c in _read_conversations(path)) if p]
    rng.shuffle(pairs)
    requests: list[TraceRequest] = []
    for prompt, reply in pairs:
        if n is not None and len(requests) >= n:
            break
        prompt_len, output_len = synth.count(prompt), synth.count(reply)
        if (prompt_len < 4 or output_len < 4 or prompt_len > max_prompt_len
                or prompt_len + output_len > max_total_len):
            continue
        requests.append(TraceRequest(max_tokens=output_len, prompt=prompt, prompt_len=prompt_len,
                                     cls="sharegpt", id=f"sharegpt-{len(requests):05d}"))
    if not requests:
        raise ValueError(f"{path}: no usable conversations")
    for r, arrival in zip(requests, arrivals.times(len(requests), rng)):
        r.arrival_s, r.cancel_after_s = arrival, cancels.draw(rng)
    header = _header("sharegpt", seed, len(requests), tokenizer_name, arrivals, cancels)
    header["source"] = {"file": Path(path).name, "max_prompt_len": max_prompt_len,
                        "max_total_len": max_total_len}
    return Trace(requests, header)


def _header(kind: str, seed: int, n: int, tokenizer_name: str, arrivals: ArrivalSpec,
            cancels: CancelSpec) -> dict[str, Any]:
    return {"format": "loom-trace", "version": TRACE_VERSION, "kind": kind, "seed": seed,
            "num_requests": n, "tokenizer": tokenizer_name,
            "token_counts": "prompt_len/max_tokens in the tokenizer's tokens, no special tokens",
            "arrivals": asdict(arrivals), "cancellations": cancels.to_json()}


def _read_conversations(path: str | Path) -> Iterable[Any]:
    """A JSON list or JSONL of conversations; a line that is not JSON is named."""
    text = _decode(Path(path).read_bytes(), path)
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
    out = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
    return out


def _first_exchange(conversation: Any) -> tuple[str, str] | None:
    """(first user turn, the assistant reply after it) of a ShareGPT or messages record;
    None for anything else (a record of another shape is skipped, not a crash)."""
    if not isinstance(conversation, dict):
        return None
    turns = conversation.get("conversations") or conversation.get("messages") or []
    if not isinstance(turns, list):
        return None
    turns = [t for t in turns if isinstance(t, dict)]
    for turn, reply in zip(turns, turns[1:]):
        role = turn.get("from", turn.get("role"))
        reply_role = reply.get("from", reply.get("role"))
        if role in ("human", "user") and reply_role in ("gpt", "assistant", "chatgpt"):
            prompt, answer = turn.get("value", turn.get("content")), reply.get(
                "value", reply.get("content"))
            if isinstance(prompt, str) and isinstance(answer, str):
                return prompt, answer
    return None
