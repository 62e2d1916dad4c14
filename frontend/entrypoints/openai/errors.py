"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` with vLLM's type
names (the `openai` client's exception class for each status) and the status as `code`.

Every failure a handler can meet becomes an `APIError`, so a response never carries a
traceback; what is not one is logged here and answered with a plain 500.
"""
from __future__ import annotations

import logging
import re
from http import HTTPStatus

import msgspec
from tidal.protocol.errors import (
    EngineDeadError,
    EngineGenerateError,
    EngineOverloadedError,
    EngineRestartingError,
)

logger = logging.getLogger(__name__)

# Retry-After (seconds) of a 503 for a request the engine refused at admission (its waiting
# queue is full, or its core is draining): short, as a queue drains within seconds.
OVERLOADED_RETRY_AFTER_S = 1
# Retry-After (seconds) of a 503 while a lost engine core is being replaced: a new core
# process starts and loads the model, which takes seconds, not one.
RESTARTING_RETRY_AFTER_S = 5

# pydantic's words and error types for a bound (vLLM's request models are pydantic's).
_BOUNDS = {
    ">=": ("greater than or equal to", "greater_than_equal"),
    ">": ("greater than", "greater_than"),
    "<=": ("less than or equal to", "less_than_equal"),
    "<": ("less than", "less_than"),
}
# msgspec's words for a Meta bound: "Expected `int` >= -1 - at `$.truncate_prompt_tokens`".
_MSGSPEC_BOUND = re.compile(r"^Expected `\w+` (>=|<=|>|<) (\S+) - at `\$((?:\.\w+|\[\d+\])*)`$")

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
    """The APIError for what generate() or a handler raised: ValueError, and a RecursionError
    from nesting too deep, are the client's mistake (400; a field out of its bounds in pydantic's words, as vLLM answers), a dead
    engine 503, one being restarted 503 with Retry-After, a request refused at admission
    (overloaded or draining) 503 with Retry-After, a per-request engine failure 500."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, msgspec.ValidationError) and (bound := _MSGSPEC_BOUND.match(str(e))):
        op, limit, path = bound.groups()
        loc = path.replace("[", ".").replace("]", "").lstrip(".")
        return APIError(range_message(loc, op, limit), HTTPStatus.BAD_REQUEST, _param_of(e))
    if isinstance(e, (ValueError, msgspec.ValidationError, msgspec.DecodeError)):
        return APIError(str(e), HTTPStatus.BAD_REQUEST, _param_of(e))
    if isinstance(e, RecursionError):  # a body (or a schema in it) nested deeper than it can be read
        return APIError("the request is nested too deeply to be read (JSON arrays or objects nested about a "
                        "thousand levels or more)", HTTPStatus.BAD_REQUEST)
    if isinstance(e, EngineRestartingError):  # before its base class, EngineDeadError
        return APIError(f"The engine is restarting: {e}", HTTPStatus.SERVICE_UNAVAILABLE,
                        headers={"Retry-After": str(RESTARTING_RETRY_AFTER_S)})
    if isinstance(e, EngineDeadError):
        return APIError(f"The engine is dead: {e}", HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(e, EngineOverloadedError):  # before its base class, EngineGenerateError
        return APIError(f"The engine cannot take the request now: {e}", HTTPStatus.SERVICE_UNAVAILABLE,
                        headers={"Retry-After": str(OVERLOADED_RETRY_AFTER_S)})
    if isinstance(e, EngineGenerateError):
        return APIError(f"The request failed in the engine: {e}", HTTPStatus.INTERNAL_SERVER_ERROR)
    logger.error("unexpected server error", exc_info=e)
    return APIError(f"Internal server error: {type(e).__name__}", HTTPStatus.INTERNAL_SERVER_ERROR)


def range_message(loc: str, op: str, limit: object, value: object = None) -> str:
    """A value out of its bounds, as pydantic words it for vLLM's `Field(ge=...)` (`op` one of
    >=, >, <=, <): "prompt.0: Input should be greater than or equal to 0
    [type=greater_than_equal, input_value=-1]"; `loc` names the field (dots into lists)."""
    words, kind = _BOUNDS[op]
    shown = "" if value is None else f", input_value={value!r}"
    return f"{loc}: Input should be {words} {limit} [type={kind}{shown}]"


def _param_of(e: BaseException) -> str | None:
    """The field msgspec names in "... - at `$.max_tokens`" (the OpenAI `param`), or a
    VLLMValidationError's parameter."""
    text = str(e)
    mark = "at `$."
    if isinstance(e, msgspec.ValidationError) and mark in text:
        return text.split(mark, 1)[1].split("`", 1)[0].split("[", 1)[0].split(".", 1)[0] or None
    parameter = getattr(e, "parameter", None)
    return parameter if isinstance(parameter, str) else None
