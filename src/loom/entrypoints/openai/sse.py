"""Server-sent events: one event per line however the JSON's text breaks, and a stream's
ending (the last event, and the event an error after the headers becomes)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from loom.engine.async_engine import EngineDeadError, RequestRejectedError
from loom.entrypoints.openai.errors import INTERNAL_ERROR, APIError, error_body
from loom.entrypoints.openai.protocol import ErrorResponse

logger = logging.getLogger(__name__)

SSE_DONE = "data: [DONE]\n\n"


# JSON may carry these raw inside strings, but many line readers (Python's str.splitlines,
# httpx's aiter_lines) break lines on them, which cuts an SSE event in two: escape them.
_LINE_BREAKS_JSON_ALLOWS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028",
                                          "\u2029": "\\u2029"})


def sse(message: BaseModel) -> str:
    return sse_json(message.model_dump_json())


def sse_json(text: str, event: str | None = None) -> str:
    """One server-sent event of JSON `text`; `event` names it on an `event:` line (the
    Responses API's)."""
    data = f"data: {text.translate(_LINE_BREAKS_JSON_ALLOWS)}\n\n"
    return data if event is None else f"event: {event}\n{data}"


@dataclass(frozen=True)
class StreamEnding:
    """How an endpoint's event stream ends: the event an error after the headers becomes,
    and what follows the last event (chat and completions: `data: [DONE]`)."""

    error_event: Callable[[ErrorResponse], str] = sse
    last: str = SSE_DONE


class Closable(Protocol):
    """What a response closes when it ends: the engine streams it read (ClientStream)."""

    def close(self) -> None: ...


def sse_response(stream: Closable, events: AsyncIterator[str],
                 ending: StreamEnding) -> StreamingResponse:
    """Send `events`, then `ending.last`. An error after the headers went out becomes
    `ending.error_event` (by default an OpenAI-style error event, as vLLM sends it); its
    text never carries an internal exception (the log does)."""

    async def body() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except APIError as e:
            yield ending.error_event(error_body(e.message, e.type, e.param))
        except (RequestRejectedError, EngineDeadError) as e:
            yield ending.error_event(error_body(str(e), "service_unavailable_error"))
        except Exception:  # noqa: BLE001 - fail this response alone
            logger.exception("Streaming response failed")
            yield ending.error_event(error_body(INTERNAL_ERROR, "internal_server_error"))
        finally:
            stream.close()
        if ending.last:
            yield ending.last

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
