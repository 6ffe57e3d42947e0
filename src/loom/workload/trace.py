"""Request traces: the JSONL format, reading, writing and hashing it.

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

import hashlib
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from loom.workload.jsonview import JsonView
from loom.workload.tokens import PromptSynth

TRACE_VERSION = 1
TOKEN_COUNTS = "prompt_len/max_tokens in the tokenizer's tokens, no special tokens"


@dataclass
class TraceRequest:
    """One request. `tenant` names who sent it (fairness per tenant); a session's turns name
    the turn before them in `after`: the client sends a turn `think_s` seconds after the
    previous one's answer ends, as a user or an agent would."""

    max_tokens: int
    cls: str = "default"
    prompt: str | None = None
    prompt_len: int | None = None
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


@dataclass(frozen=True)
class TraceInfo(JsonView):
    """What a result records about the trace it replayed (its sha256 names the file)."""

    path: str | None = None
    sha256: str | None = None
    num_requests: int | None = None
    header: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trace:
    requests: list[TraceRequest]
    header: dict[str, Any] = field(default_factory=dict)
    sha256: str | None = None
    path: str | None = None

    def describe(self) -> TraceInfo:
        return TraceInfo(self.path, self.sha256, len(self.requests), self.header)


def load_trace(path: str | Path) -> Trace:
    """Read and check a trace; every error names the file, the line and the field."""
    data = Path(path).read_bytes()
    header: dict[str, Any] = {}
    requests = []
    seen: dict[str, int] = {}
    for number, obj in jsonl_records(decode(data, path), path, "a request"):
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


def jsonl_records(text: str, path: str | Path,
                  what: str | None = None) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of JSONL text (a trace, a request log,
    conversations); a line that is not JSON, or with `what` not an object, is named."""
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number}: not JSON ({e.msg})") from None
        if what is not None and not isinstance(obj, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object ({what}), got "
                             f"{type(obj).__name__}")
        yield number, obj


def decode(data: bytes, path: str | Path) -> str:
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


def header(kind: str, seed: int, num_requests: int, tokenizer_name: str) -> dict[str, Any]:
    """What every trace header states: how it was made, and what its lengths count."""
    return {"format": "loom-trace", "version": TRACE_VERSION, "kind": kind, "seed": seed,
            "num_requests": num_requests, "tokenizer": tokenizer_name,
            "token_counts": TOKEN_COUNTS}
