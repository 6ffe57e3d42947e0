"""Everything that goes wrong becomes an OpenAI-style error body with the right status.

Bad input is a 400 naming the field, admission control and a dead engine are a 503 (with
Retry-After when retrying helps), and anything unexpected is a 500 for that request alone,
whose body says nothing of the exception: the log has it, a client (or an attacker) needs none
of it (guards.RequestContext answers those, and logs each once).
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from loom.engine.async_engine import EngineDeadError, RequestRejectedError
from loom.entrypoints.openai.protocol import LONE_SURROGATE, ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # a queue slot usually frees within a few steps
INTERNAL_ERROR = "internal server error; the server log says what went wrong"


class APIError(Exception):
    """An error to answer with: raise it anywhere in a handler."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error",
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.type = status, message, param, type_
        self.headers = headers


def error_body(message: str, type_: str, param: str | None = None) -> ErrorResponse:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param))


def error_response(status: int, message: str, param: str | None = None,
                   type_: str = "invalid_request_error",
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param).model_dump(), status_code=status,
                        headers=headers)


def _validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for the first problem pydantic found."""
    first = exc.errors()[0]
    if first["type"] == LONE_SURROGATE:  # a whole-body check: its message names the field
        return first["msg"], str(first["ctx"]["field"]).split(".")[0]
    if first["type"] == "json_invalid":
        return f"malformed JSON body: {first.get('ctx', {}).get('error', first['msg'])}", None
    # loc is ("body", field, index or nested field ..., possibly a union member's type name)
    path = [str(p) for p in first["loc"][1:] if not (isinstance(p, str) and "[" in p)]
    path = [p for p in path if p not in ("str", "int", "float", "bool")]
    param = path[0] if path else None
    return f"{'.'.join(path) or 'request body'}: {first['msg']}", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_error(exc)
        return error_response(400, message, param)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.type, exc.headers)

    @app.exception_handler(RequestRejectedError)
    async def _rejected(request: Request, exc: RequestRejectedError) -> JSONResponse:
        return error_response(503, str(exc), type_="service_unavailable_error",
                              headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineDeadError)
    async def _dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        logger.error("Answering 503: %s", exc)
        return error_response(503, str(exc), type_="service_unavailable_error")

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), type_="invalid_request_error",
                              headers=exc.headers)
