"""POST /v1/completions: prompts (text or token ids, one or a batch) x n choices, streamed or
not, with OpenAI's legacy logprobs and `echo`.

`echo` with `logprobs` is how lm-eval's local-completions scores text: the prompt comes back
with a log-probability per token (None for the first). `max_tokens: 0` means "score the prompt
only"; the engine always samples at least one token, so it runs with one and drops it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request, Response

from loom.engine.async_engine import EngineRequest
from loom.entrypoints.openai.errors import APIError
from loom.entrypoints.openai.protocol import CompletionRequest
from loom.entrypoints.openai.protocol_answers import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    UsageInfo,
)
from loom.entrypoints.openai.serving import Choice, ClientStream, OpenAIServing, usage
from loom.entrypoints.openai.sse import sse
from loom.outputs import RequestOutput, TokenLogprob

_PIECE_WINDOW = 8  # tokens decoded together at most when splitting a prompt into pieces


@dataclass
class _Choice(Choice):
    """A completion choice also echoes its prompt and tracks legacy logprobs' text offsets."""

    prompt_text: str = ""
    # echoed: the text each prompt token adds to prompt_text, so that the echoed text and
    # logprobs.text_offset agree (None: no echo)
    prompt_pieces: list[str] | None = None
    prompt_tokens: int = 0
    first_of_prompt: bool = True  # the prompt's usage (cached tokens) is counted once
    echoed: bool = False
    text_offset: int = 0  # where the next token's text starts, for logprobs.text_offset
    answer_pieces: TokenPieces | None = None  # the generated tokens' texts, for text_offset


class CompletionServing(OpenAIServing):
    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        completion_id = f"cmpl-{uuid.uuid4().hex}"
        score_only = request.max_tokens == 0
        if score_only and not request.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 is allowed only with "
                           "echo=true, to score the prompt)", "max_tokens")
        api_names = {"prompt_logprobs": "logprobs"}
        constraint = await self.structured_outputs(request, raw_request)
        requests, choices, num_prompt_tokens = [], {}, 0
        for p, prompt in enumerate(request.prompts()):
            token_ids = await self._prompt_tokens(prompt)
            num_prompt_tokens += len(token_ids)
            max_tokens = self.max_tokens(1 if score_only else request.max_tokens,
                                         len(token_ids), "prompt")
            # echoed: the text each prompt token adds, so that logprobs.text_offset counts
            # characters of the echoed text (a text prompt is echoed as sent)
            pieces = (await asyncio.to_thread(token_pieces, self.tokenizer, token_ids)
                      if request.echo else None)
            if pieces and isinstance(prompt, str) and "".join(pieces[1:]) == prompt:
                pieces[0] = ""  # a BOS the tokenizer added is no text of the prompt's
            text = prompt if isinstance(prompt, str) else "".join(pieces or [])
            for i in range(request.n):
                index = p * request.n + i
                params = self.sampling_params(
                    request, i, api_names, max_tokens=max_tokens, logprobs=request.logprobs,
                    prompt_logprobs=request.logprobs if request.echo else None,
                    structured_outputs=constraint and constraint.params)
                request_id = f"{completion_id}-{index}"
                requests.append(EngineRequest(request_id, token_ids, params, request.priority))
                choices[request_id] = _Choice(index, prompt_text=text, prompt_pieces=pieces,
                                              prompt_tokens=len(token_ids),
                                              first_of_prompt=i == 0)
        created = int(time.time())

        def total_usage(finals: list[RequestOutput]) -> UsageInfo:
            cached = sum(o.num_cached_tokens for o in finals
                         if choices[o.request_id].first_of_prompt)
            return usage([] if score_only else finals, num_prompt_tokens, cached)

        def events(stream: ClientStream, first: list[RequestOutput]) -> AsyncIterator[str]:
            def chunk(output: RequestOutput, choice: _Choice) -> str | None:
                delta = self._delta(request, output, choice, score_only)
                if not output.finished and not delta.text and delta.logprobs is None:
                    return None  # tokens that are no text yet (half a UTF-8 char, a stop prefix)
                so_far = (usage([] if score_only else [output], choice.prompt_tokens,
                                output.num_cached_tokens) if request.continuous_usage else None)
                return sse(CompletionResponse(id=completion_id, created=created,
                                              model=self.model_name, choices=[delta],
                                              usage=so_far))

            def usage_chunk(finals: list[RequestOutput]) -> str:
                return sse(CompletionResponse(
                    id=completion_id, created=created, model=self.model_name, choices=[],
                    usage=total_usage(finals)))

            return self.stream_events(stream, first, choices, chunk,
                                      usage_chunk if request.include_usage else None)

        def response(finals: dict[str, RequestOutput]) -> CompletionResponse:
            return CompletionResponse(
                id=completion_id, created=created, model=self.model_name,
                choices=[self._delta(request, finals[rid], choice, score_only)
                         for rid, choice in choices.items()],
                usage=total_usage(list(finals.values())))

        return await self.respond(raw_request, requests, "prompt", request.stream, events,
                                  response, constraint=constraint)

    async def _prompt_tokens(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self.encode(prompt)
        self.check_token_ids(prompt, "prompt")
        return prompt

    def _delta(self, request: CompletionRequest, output: RequestOutput, choice: _Choice,
               score_only: bool) -> CompletionChoice:
        """What the choice gained since it last sent: everything, for a non-streamed answer."""
        completion = output.outputs[0]
        text, start = choice.progress.advance(completion)
        end = len(completion.token_ids)
        if score_only:
            text, start, end = "", 0, 0
        echo = request.echo and not choice.echoed
        choice.echoed = choice.echoed or echo
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs()
            if echo:
                self._add_logprobs(logprobs, choice, output.prompt_token_ids,
                                   output.prompt_logprobs or [], choice.prompt_pieces)
            self._add_logprobs(logprobs, choice, completion.token_ids[start:end],
                               (completion.logprobs or [])[start:end])
        finish_reason = None
        if output.finished:
            finish_reason = "length" if score_only else completion.finish_reason
        return CompletionChoice(
            index=choice.index, text=(choice.prompt_text if echo else "") + text,
            logprobs=logprobs, finish_reason=finish_reason,
            stop_reason=completion.stop_reason if output.finished else None)

    def _add_logprobs(self, into: CompletionLogprobs, choice: _Choice, token_ids: list[int],
                      entries: list[TokenLogprob | None],
                      pieces: list[str] | None = None) -> None:
        """Legacy logprobs: per token its text, offset, logprob, and {token: logprob} of the
        sampled token plus the top-N (the sampled one included, as vLLM does)."""
        if pieces is None:
            choice.answer_pieces = choice.answer_pieces or TokenPieces(self.tokenizer)
        for i, (token_id, entry) in enumerate(zip(token_ids, entries)):
            token = self.tokenizer.id_to_token(token_id)
            into.tokens.append(token)
            into.text_offset.append(choice.text_offset)
            choice.text_offset += len(choice.answer_pieces.push(token_id) if pieces is None
                                      else pieces[i])
            if entry is None:  # the first prompt token: nothing came before it
                into.token_logprobs.append(None)
                into.top_logprobs.append(None)
                continue
            top = {token: entry.logprob}
            top.update((self.tokenizer.id_to_token(t), lp) for t, lp in entry.top)
            into.token_logprobs.append(entry.logprob)
            into.top_logprobs.append(top)


class TokenPieces:
    """The text each token adds to the decoded whole (special tokens kept), token by token, so
    that their concatenation is the text: a token that ends inside a UTF-8 character adds
    nothing, and the one completing it adds the character. It keeps its place between calls,
    so a streamed answer's tokens split as the whole answer's would."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.window: list[int] = []  # tokens since the window last restarted, at a character
        self.text = ""  # their text, up to the last whole character

    def push(self, token_id: int) -> str:
        self.window.append(token_id)
        decoded = self.tokenizer.decode(self.window, skip_special_tokens=False)
        if decoded.endswith("\ufffd"):  # an incomplete character: wait for its last byte
            return ""
        piece = decoded[len(self.text):]
        if len(self.window) >= _PIECE_WINDOW:  # restart the window at a whole character
            self._restart()
        else:
            self.text = decoded
        return piece


    def _restart(self) -> None:
        """Keep only the window's last whole character (its last token, or the byte tokens
        that spell it): its text is sent already, and it stands before the next token, whose
        text a window starting with it would lose a space of (decoding strips the space that
        SentencePiece's prefix puts before a text, from whatever a window starts with)."""
        for start in range(len(self.window) - 1, -1, -1):
            tail = self.window[start:]
            text = self.tokenizer.decode(tail, skip_special_tokens=False)
            if "\ufffd" not in text:
                self.window, self.text = tail, text
                return
        self.window, self.text = [], ""


def token_pieces(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """TokenPieces of a whole token list."""
    pieces = TokenPieces(tokenizer)
    return [pieces.push(t) for t in token_ids]
