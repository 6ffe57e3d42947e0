"""One request's grammar matcher: compiled off the step loop, then advanced token by token.

The scheduler sees only `ready`, `accept` and `terminated`; the manager fills the request's
row of a step's bitmask. Tokens are accepted only once they are final (constrained requests
take no draft tokens and no async-scheduling placeholder), so there is never anything to roll
back, and preemption (recompute) leaves the matcher as it is: it re-feeds tokens already
accepted, it does not sample them again.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from typing import Any

from loom.structured import GRAMMAR_ERROR_PREFIX
from loom.structured.grammar import StructuredOutputsError, client_reason

logger = logging.getLogger(__name__)


class GrammarState:
    """The matcher of one request, once its compile (a Future of an llguidance LLMatcher) is
    done."""

    def __init__(self, request_id: str, compiled: Future[Any]) -> None:
        self.request_id = request_id
        self._compiled = compiled
        self._matcher: Any = None
        self.error: str | None = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed: `error` says why); only then may the request be scheduled."""
        if self._matcher is None and self.error is None and self._compiled.done():
            try:
                self._matcher = self._compiled.result()
            except StructuredOutputsError as e:
                self.error = f"{GRAMMAR_ERROR_PREFIX}{e.kind}: {e.detail}"
            except Exception as e:  # noqa: BLE001 - the request fails alone, with the reason
                self.error = f"{GRAMMAR_ERROR_PREFIX}{e}"
        return self._matcher is not None or self.error is not None

    @property
    def matcher(self) -> Any:
        return self._matcher

    def num_allowed(self, token_ids: list[int]) -> int:
        """How many of these tokens, in order, the grammar would take from its present state
        (the matcher does not move)."""
        return self._matcher.validate_tokens(token_ids)

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token; False if the grammar refuses it, and `error` says why.
        The mask allowed the token, so the grammar needs text the vocabulary cannot write
        (llguidance then forces a token its parser refuses): the client's constraint."""
        if self._matcher.consume_token(token_id):
            return True
        reason = client_reason(self._matcher.get_error())
        logger.warning("request %s: the grammar refused token %d: %s", self.request_id,
                       token_id, reason)
        self.error = (f"{GRAMMAR_ERROR_PREFIX}the constraint needs text this model's "
                      f"vocabulary cannot write ({reason})")
        return False

    @property
    def terminated(self) -> bool:
        """The grammar is complete and took its end (EOS): the request must stop."""
        return self._matcher.is_stopped()
