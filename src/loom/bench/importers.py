"""Traces from outside data: production logs (`loom bench trace --from-log FILE --format
FORMAT`) and ShareGPT-style conversations (`--from-sharegpt FILE`).

Three log formats, each read from its published columns:

- `openai`: JSONL of logged requests, one per line: a timestamp (`timestamp`, `created` or
  `time`: epoch seconds or milliseconds, or ISO 8601), the request body (under `request` or
  `body`, or the record itself) with `prompt` or `messages`, and optionally the `response`
  (its text, or `usage.completion_tokens`), a `tenant` (else the body's `user`) and a
  `session_id` / `conversation_id` that makes the records of one conversation a session.
- `azure`: the Azure LLM inference trace CSV, `TIMESTAMP,ContextTokens,GeneratedTokens`.
- `mooncake`: Mooncake's JSONL, `timestamp` (ms), `input_length`, `output_length` and
  `hash_ids`, the ids of the prompt's blocks (`--hash-block-size` tokens each; equal ids are
  shared prefix blocks).

Arrival times are kept, relative to the first request and multiplied by `--time-scale`.
Lengths are the target model's tokens: logged text is counted with its tokenizer; formats
that give only counts are taken as counts of it. Mooncake prompts are written from their
hash_ids (same id, same synthetic block), so the replay has the log's prefix sharing. Classes
come from rules over prompt_len, output_len, prefix_len (tokens shared with an earlier
request) and tenant; see `Classifier`.
"""

from __future__ import annotations

import csv
import datetime
import json
import operator
import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from loom.bench.anonymize import (
    DEFAULT_BLOCK_SIZE,
    BlockText,
    block_hashes,
    shared_prefix_lens,
)
from loom.workload.mix import ArrivalSpec, CancelSpec, drawn_header
from loom.workload.tokens import PromptSynth
from loom.workload.trace import Trace, TraceRequest, decode, header, jsonl_records

FORMATS = ("openai", "azure", "mooncake")
DEFAULT_RULES = "rag:prefix_len>=256,long:prompt_len>=500,chat:*"
MOONCAKE_BLOCK_SIZE = 512

_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">=": operator.ge, "<=": operator.le, "!=": operator.ne, "==": operator.eq,
    ">": operator.gt, "<": operator.lt, "=": operator.eq}
_CONDITION = re.compile(r"(prompt_len|output_len|prefix_len|tenant)\s*(>=|<=|!=|==|>|<|=)\s*"
                        r"(\S+)")


@dataclass(frozen=True)
class Record:
    """One logged request, before classification."""

    arrival_s: float
    prompt_len: int
    output_len: int
    prompt: str | None = None
    blocks: tuple[object, ...] = ()  # names of its prompt's blocks, for prefix sharing
    tenant: str | None = None
    session: str | None = None


class Classifier:
    """Rules 'CLASS:COND&COND,...,CLASS:*', first match wins, e.g. the default
    'rag:prefix_len>=256,long:prompt_len>=500,chat:*'. COND compares prompt_len, output_len,
    prefix_len (numbers) or tenant (==, !=) with a value."""

    def __init__(self, text: str = DEFAULT_RULES) -> None:
        self.text = text
        self.rules: list[tuple[str, list[tuple[str, Callable, Any]]]] = []
        for part in (p.strip() for p in text.split(",") if p.strip()):
            name, sep, conditions = part.partition(":")
            if not sep or not name.strip():
                raise ValueError(f"bad --classify rule {part!r}; use CLASS:COND, e.g. "
                                 "long:prompt_len>=500 (or CLASS:* for the rest)")
            self.rules.append((name.strip(), self._conditions(conditions.strip(), part)))

    @staticmethod
    def _conditions(text: str, part: str) -> list[tuple[str, Callable, Any]]:
        if text == "*":
            return []
        out = []
        for cond in text.split("&"):
            match = _CONDITION.fullmatch(cond.strip())
            if not match:
                raise ValueError(f"bad condition {cond!r} in --classify rule {part!r}")
            field, op, value = match.groups()
            out.append((field, _OPS[op], value if field == "tenant" else float(value)))
        return out

    def __call__(self, values: dict[str, Any]) -> str:
        for name, conditions in self.rules:
            if all(values[f] is not None and op(values[f], v) for f, op, v in conditions):
                return name
        return "default"


def import_log(path: str | Path, fmt: str, synth: PromptSynth, classify: Classifier,
               time_scale: float = 1.0, n: int | None = None, seed: int = 0,
               hash_block_size: int = MOONCAKE_BLOCK_SIZE, tokenizer_name: str = "") -> Trace:
    """The log as a trace (see the module doc)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown log format {fmt!r}; known: {', '.join(FORMATS)}")
    if not 0 < time_scale < float("inf"):
        raise ValueError("--time-scale must be > 0")
    if hash_block_size < 1:
        raise ValueError(f"--hash-block-size must be >= 1, got {hash_block_size}")
    readers = {"openai": lambda: _openai(path, synth),
               "azure": lambda: _azure(path),
               "mooncake": lambda: _mooncake(path, hash_block_size)}
    records = sorted(readers[fmt](), key=lambda r: r.arrival_s)[:n]
    if not records:
        raise ValueError(f"{path}: no usable records")
    block_size = hash_block_size if fmt == "mooncake" else DEFAULT_BLOCK_SIZE
    prefix = shared_prefix_lens([list(r.blocks) for r in records],
                                [r.prompt_len for r in records], block_size)
    texts = BlockText(synth, seed) if fmt == "mooncake" else None
    t0 = records[0].arrival_s
    last_of_session: dict[str, str] = {}
    requests = []
    for i, (record, shared) in enumerate(zip(records, prefix)):
        cls = classify({"prompt_len": record.prompt_len, "output_len": record.output_len,
                        "prefix_len": shared, "tenant": record.tenant})
        request = TraceRequest(
            max_tokens=record.output_len, prompt=record.prompt, prompt_len=record.prompt_len,
            cls=cls, arrival_s=round((record.arrival_s - t0) * time_scale, 4),
            id=f"{cls}-{i:05d}", tenant=record.tenant, session=record.session,
            after=last_of_session.get(record.session) if record.session else None)
        if record.session:
            last_of_session[record.session] = request.id
        if texts is not None:
            request = replace(request, prompt=texts.prompt(list(record.blocks),
                                                           record.prompt_len, block_size))
            request.prompt_len = synth.count(request.prompt)
        requests.append(request)
    made = header("log", seed, len(requests), tokenizer_name)
    made["source"] = {"format": fmt, "file": Path(path).name, "time_scale": time_scale,
                      "classify": classify.text,
                      **({"hash_block_size": hash_block_size} if fmt == "mooncake" else {})}
    return Trace(requests, made)


# -- readers -----------------------------------------------------------------------------------

def _jsonl(path: str | Path) -> Iterable[tuple[int, dict[str, Any]]]:
    return jsonl_records(decode(Path(path).read_bytes(), path), path, "a logged request")


def _seconds(value: Any, where: str) -> float:
    """A timestamp -> seconds: a number (seconds, or milliseconds when it looks like epoch
    ms) or an ISO 8601 / 'YYYY-MM-DD HH:MM:SS.fffffff' string."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value / 1000 if value > 1e11 else float(value)
    if isinstance(value, str):
        text = re.sub(r"(\.\d{6})\d+", r"\1", value.strip()).replace("Z", "+00:00")
        try:
            stamp = datetime.datetime.fromisoformat(text)
        except ValueError:
            pass
        else:
            if stamp.tzinfo is None:
                stamp = stamp.replace(tzinfo=datetime.timezone.utc)
            return stamp.timestamp()
    raise ValueError(f"{where}: unreadable timestamp {value!r}")


def _openai(path: str | Path, synth: PromptSynth) -> list[Record]:
    records = []
    for number, obj in _jsonl(path):
        where = f"{path}:{number}"
        stamp = next((obj[k] for k in ("timestamp", "created", "time") if k in obj), None)
        if stamp is None:
            raise ValueError(f"{where}: needs a timestamp (timestamp, created or time)")
        body = obj.get("request") or obj.get("body") or obj
        if not isinstance(body, dict):
            raise ValueError(f"{where}: request must be a JSON object (the request body)")
        prompt = _prompt_text(body, where)
        output = _output_len(obj.get("response") or {}, body, synth, where)
        ids = synth.tokenizer.encode(prompt, add_special_tokens=False).ids
        records.append(Record(
            _seconds(stamp, where), len(ids), output, prompt,
            tuple(block_hashes(ids, DEFAULT_BLOCK_SIZE)),
            tenant=_str(obj.get("tenant") or body.get("user") or obj.get("user")),
            session=_str(obj.get("session_id") or obj.get("conversation_id"))))
    return records


def _str(value: Any) -> str | None:
    return None if value is None else str(value)


def _prompt_text(body: dict[str, Any], where: str) -> str:
    """A completion's prompt, or a chat's messages one per line as 'role: content'."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        return "\n".join(f"{m.get('role', 'user')}: {_content(m.get('content'))}"
                         for m in messages)
    raise ValueError(f"{where}: the request has neither prompt (text) nor messages")


def _content(content: Any) -> str:
    """Message content: text, or the text parts of a list of content parts."""
    if isinstance(content, list):
        return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


def _output_len(response: Any, body: dict[str, Any], synth: PromptSynth,
                where: str) -> int:
    """Tokens of the logged answer (the response's text, or the response given as its
    text) in the target's tokenizer; else the logged usage; else the request's own limit."""
    if isinstance(response, str):
        return max(1, synth.count(response))
    if not isinstance(response, dict):
        raise ValueError(f"{where}: response must be its text or a JSON object, got "
                         f"{type(response).__name__}")
    choices = response.get("choices") or []
    if choices and isinstance(choices[0], dict):
        text = choices[0].get("text")
        if text is None:
            text = _content((choices[0].get("message") or {}).get("content"))
        if text:
            return max(1, synth.count(text))
    usage = response.get("usage") if isinstance(response.get("usage"), dict) else {}
    for value in (usage.get("completion_tokens"),
                  body.get("max_completion_tokens"), body.get("max_tokens")):
        if isinstance(value, int) and value > 0:
            return value
    raise ValueError(f"{where}: no output length (response text, usage.completion_tokens or "
                     "max_tokens)")


def _azure(path: str | Path) -> list[Record]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"TIMESTAMP", "ContextTokens", "GeneratedTokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not an Azure LLM inference trace (missing "
                             f"{', '.join(sorted(missing))})")
        return [Record(_seconds(row["TIMESTAMP"], f"{path}:{number}"),
                       max(1, int(row["ContextTokens"])), max(1, int(row["GeneratedTokens"])))
                for number, row in enumerate(reader, 2)]


def _mooncake(path: str | Path, block_size: int) -> list[Record]:
    records = []
    for number, obj in _jsonl(path):
        where = f"{path}:{number}"
        try:
            length, output = int(obj["input_length"]), int(obj["output_length"])
            hash_ids = list(obj.get("hash_ids") or [])
            stamp = obj["timestamp"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{where}: needs timestamp, input_length, output_length") from None
        # blocks the log does not name are this request's own
        needed = -(-length // block_size)
        hash_ids += [f"{number}:{k}" for k in range(len(hash_ids), needed)]
        records.append(Record(float(stamp) / 1000, max(1, length), max(1, output),
                              blocks=tuple(hash_ids)))
    return records


# -- ShareGPT ---------------------------------------------------------------------------------

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
    made = drawn_header("sharegpt", seed, len(requests), tokenizer_name, arrivals, cancels)
    made["source"] = {"file": Path(path).name, "max_prompt_len": max_prompt_len,
                      "max_total_len": max_total_len}
    return Trace(requests, made)


def _read_conversations(path: str | Path) -> Iterable[Any]:
    """A JSON list or JSONL of conversations; a line that is not JSON is named."""
    text = decode(Path(path).read_bytes(), path)
    if text.lstrip().startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: not JSON ({e.msg})") from None
    return [obj for _, obj in jsonl_records(text, path)]


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
