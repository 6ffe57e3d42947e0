"""One streaming request, timed from the client's side: /v1/completions, or
/v1/chat/completions for servers that offer only chat, or /v1/responses, OpenAI's Responses API
that agent frameworks speak (each prompt one user message or `input`, which the server's chat
template wraps in its own tokens).

Only what any OpenAI-compatible server does is assumed: SSE chunks of `choices[0].text` (chat:
`choices[0].delta.content`), an optional usage chunk, `data: [DONE]`; on /v1/responses, typed
events (`response.output_text.delta`, then `response.completed` or `response.incomplete` with
the usage, or `error`) and no `[DONE]`. Output lengths are the trace's because the request
asks for `ignore_eos` with its token budget. Every request ends in exactly one status
(workload/requests.py), so nothing a server refuses or breaks goes uncounted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from loom.workload.requests import CANCELLED, ERROR, OK, REJECTED, TIMEOUT, RequestResult
from loom.workload.trace import TraceRequest

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
             "responses": "/v1/responses"}
RESPONSES_ENDS = ("response.completed", "response.incomplete")  # the stream's last event


def completion_payload(request: TraceRequest, model: str,
                       extra: dict[str, Any] | None = None,
                       endpoint: str = "completions") -> dict[str, Any]:
    """The request body for `endpoint` (a key of ENDPOINTS); `extra` adds or overrides fields
    (token-id prompts, temperature)."""
    asked: dict[str, Any] = {
        "completions": {"prompt": request.prompt, "max_tokens": request.max_tokens,
                        "stream_options": {"include_usage": True}},
        "chat": {"messages": [{"role": "user", "content": request.prompt}],
                 "max_completion_tokens": request.max_tokens,
                 "stream_options": {"include_usage": True}},
        "responses": {"input": request.prompt, "max_output_tokens": request.max_tokens},
    }[endpoint]  # (a Responses stream always ends with its usage)
    payload: dict[str, Any] = {"model": model, **asked, "stream": True, "ignore_eos": True}
    if request.priority is not None:  # only when asked: some servers refuse it under fcfs
        payload["priority"] = request.priority
    if request.temperature is not None:  # else the server's default, whatever it is
        payload["temperature"] = request.temperature
    return {**payload, **(extra or {})}


async def send(client: httpx.AsyncClient, url: str, request: TraceRequest, model: str,
               result: RequestResult, run_start: float,
               extra: dict[str, Any] | None = None,
               endpoint: str = "completions") -> RequestResult:
    """Send `request` to `url`, the server's `endpoint` (a key of ENDPOINTS); fill `result`;
    closes the stream after `cancel_after_s` if set."""
    t0 = time.perf_counter()
    result.start_s = t0 - run_start
    payload = completion_payload(request, model, extra, endpoint)
    try:
        if request.cancel_after_s is None:
            await _stream(client, url, payload, result, t0, endpoint)
        else:
            await asyncio.wait_for(_stream(client, url, payload, result, t0, endpoint),
                                   request.cancel_after_s)
    except asyncio.TimeoutError:
        result.status = CANCELLED
        result.e2e_s = time.perf_counter() - t0
    except httpx.TimeoutException as e:  # --request-timeout: an outcome of overload
        result.status, result.error = TIMEOUT, f"timeout: {type(e).__name__}"
    except Exception as e:  # any failure is one counted error, never a crashed run
        result.status, result.error = ERROR, f"{type(e).__name__}: {e}"
    return result


async def _stream(client: httpx.AsyncClient, url: str, payload: dict[str, Any],
                  result: RequestResult, t0: float, endpoint: str) -> None:
    async with client.stream("POST", url, json=payload) as response:
        result.http_status = response.status_code
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")[:500]
            result.retry_after = response.headers.get("retry-after")
            result.status = REJECTED if response.status_code in (429, 503) else ERROR
            result.error = f"HTTP {response.status_code}: {body}"
            return
        last = None
        usage_tokens = None
        done = False
        async for line in sse_lines(response):
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                break
            now = time.perf_counter()
            chunk = json.loads(data)
            if "error" in chunk or chunk.get("type") in ("error", "response.failed"):
                result.status, result.error = ERROR, f"stream error: {chunk.get('error', chunk)}"
                return
            if usage := _usage(chunk, endpoint):
                usage_tokens = usage.get("completion_tokens", usage_tokens)
                if result.prompt_len is None:  # a trace of plain text: the server's count
                    result.prompt_len = usage.get("prompt_tokens")
            if chunk.get("type") in RESPONSES_ENDS:
                done = True
                break
            if not _chunk_text(chunk, endpoint):
                continue
            if last is None:
                result.ttft_s = now - t0
            else:
                result.itls_s.append(now - last)
            last = now
            result.output_tokens += 1
        result.e2e_s = time.perf_counter() - t0
        if usage_tokens is not None:  # a chunk may carry several tokens; usage counts them
            result.output_tokens = usage_tokens
        if not done:
            result.status, result.error = ERROR, "stream ended without [DONE]"
        elif result.ttft_s is None:
            result.status, result.error = ERROR, "no tokens in the response"
        else:
            result.status = OK


def _usage(chunk: dict[str, Any], endpoint: str) -> dict[str, Any] | None:
    """The usage a stream chunk carries, in the completions API's names."""
    if endpoint != "responses":
        return chunk.get("usage")
    usage = (chunk.get("response") or {}).get("usage")
    if not usage:
        return None
    return {"completion_tokens": usage.get("output_tokens"),
            "prompt_tokens": usage.get("input_tokens")}


def _chunk_text(chunk: dict[str, Any], endpoint: str) -> str | None:
    """The output text a stream chunk carries (a chat's first chunk carries only its role)."""
    if endpoint == "responses":
        return chunk.get("delta") if chunk.get("type") == "response.output_text.delta" else None
    choices = chunk.get("choices") or []
    if not choices:
        return None
    if endpoint == "chat":
        return (choices[0].get("delta") or {}).get("content")
    return choices[0].get("text")


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """Lines of an event stream, split only where SSE splits them (LF, CR LF). httpx's
    aiter_lines also splits on U+2028, NEL and friends, which servers may send raw inside
    JSON strings (vLLM and pydantic do), cutting an event in two."""
    buffer = ""
    async for text in response.aiter_text():
        buffer += text
        *lines, buffer = buffer.split("\n")
        for line in lines:
            yield line.removesuffix("\r")
    if buffer:
        yield buffer.removesuffix("\r")
