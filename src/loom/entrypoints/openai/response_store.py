"""The responses /v1/responses keeps, so that a client can continue a conversation by naming
the last answer (`previous_response_id`) instead of sending it all again, and read or delete
one (GET and DELETE /v1/responses/{id}), as OpenAI's API lets it.

They are kept in this process's memory, the most recent `capacity` of them (`loom serve
--max-stored-responses`); the oldest goes first, and a restart forgets them all. A request
with `store: false` is not kept. Each entry
is the response as it was answered and its conversation as chat turns: the earlier turns,
this request's input and the answer, but not the request's `instructions` (OpenAI carries
those over to no later response either).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import ChatMessage
from loom.entrypoints.openai.protocol_responses import ResponseObject


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    conversation: list[ChatMessage]


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # >= 0: ServerConfig checks --max-stored-responses
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: ResponseObject, conversation: list[ChatMessage]) -> None:
        """Keep the response (with store true: as it will be read back)."""
        if self.capacity == 0:
            return
        self._entries[response.id] = StoredResponse(response, conversation)
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response; a 404 naming `param` (the request field that named it, if
        any) when this server has none by that id."""
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(404, f"no stored response with id {response_id!r} (responses are "
                           f"kept in memory, the last {self.capacity}, until a restart)",
                           param, "not_found_error")
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def __len__(self) -> int:
        return len(self._entries)
