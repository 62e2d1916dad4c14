"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with vLLM's type
names (the `openai` client's exception class for each status) and the status as `code`.

Every failure a handler can meet becomes an `APIError`, so a response never carries a
traceback; what is not one is logged here and answered with a plain 500.
"""
from __future__ import annotations

import logging
from http import HTTPStatus

import msgspec
from tidal.protocol.errors import EngineDeadError, EngineGenerateError, EngineOverloadedError

logger = logging.getLogger(__name__)

# Retry-After (seconds) of a 503 for a request the engine refused at admission (its waiting
# queue is full, or its core is draining): short, as a queue drains within seconds.
OVERLOADED_RETRY_AFTER_S = 1

_TYPES = {
    HTTPStatus.BAD_REQUEST: "BadRequestError",
    HTTPStatus.UNAUTHORIZED: "AuthenticationError",
    HTTPStatus.NOT_FOUND: "NotFoundError",
    HTTPStatus.METHOD_NOT_ALLOWED: "MethodNotAllowedError",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "RequestTooLargeError",
    HTTPStatus.INTERNAL_SERVER_ERROR: "InternalServerError",
    HTTPStatus.SERVICE_UNAVAILABLE: "ServiceUnavailableError",
}


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class APIError(Exception):
    """An error the server answers with `status` and an OpenAI-shaped body."""

    def __init__(self, message: str, status: HTTPStatus = HTTPStatus.BAD_REQUEST,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param = message, HTTPStatus(status), param
        self.headers: dict[str, str] = headers or {}  # extra response headers (Retry-After)

    def to_response(self) -> ErrorResponse:
        kind = _TYPES.get(self.status, self.status.phrase.replace(" ", "") + "Error")
        return ErrorResponse(ErrorInfo(self.message, kind, self.param, int(self.status)))

    def encode(self) -> bytes:
        return msgspec.json.encode(self.to_response())


def from_exception(e: BaseException) -> APIError:
    """The APIError for what generate() or a handler raised: ValueError is the client's
    mistake (400), a dead engine 503, a request refused at admission (overloaded or draining)
    503 with Retry-After, a per-request engine failure 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, (ValueError, msgspec.ValidationError, msgspec.DecodeError)):
        return APIError(str(e), HTTPStatus.BAD_REQUEST, _param_of(e))
    if isinstance(e, EngineDeadError):
        return APIError(f"The engine is dead: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(e, EngineOverloadedError):  # before its base class, EngineGenerateError
        return APIError(f"The engine cannot take the request now: {e}", HTTPStatus.SERVICE_UNAVAILABLE,
                        headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)})
    if isinstance(e, EngineGenerateError):
        return APIError(f"The request failed in the engine: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)
    logger.error("unexpected server error", exc_info=e)
    return APIError(f"Internal server error: {type(e).__name__}", HTTPStatus.INTERNAL_SERVER_ERROR)


def _param_of(e: BaseException) -> str | None:
    """The field msgspec names in "... - at `$.max_tokens`" (the OpenAI `param`)."""
    text = str(e)
    mark = "at `$."
    if isinstance(e, msgspec.ValidationError) and mark in text:
        return text.split(mark, 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0] or None
    return None
