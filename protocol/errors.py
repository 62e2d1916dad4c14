"""Errors users catch, named as in vLLM."""
from typing import Any


class VLLMValidationError(ValueError):
    """vLLM's request-validation error: a ValueError naming the parameter and the value refused
    (`str()` appends them, as vLLM's does)."""

    def __init__(self, message: str, *, parameter: str | None = None, value: Any = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value

    def __str__(self) -> str:
        extras = [f"{k}={v}" for k, v in (("parameter", self.parameter), ("value", self.value)) if v is not None]
        base = super().__str__()
        return f"{base} ({', '.join(extras)})" if extras else base


class EngineDeadError(RuntimeError):
    """The engine core (or one of its workers) is gone; every call fails with this from now on."""

    def __init__(self, message: str = "Engine core is dead; see the log for the original error.") -> None:
        super().__init__(message)


class EngineRestartingError(EngineDeadError):
    """The engine core is gone and a replacement is starting (LOST or RECONNECTING): raised by
    `AsyncLLM.check_health()` until the new core answers. An EngineDeadError, so a vLLM-style
    health endpoint (which answers 503 for EngineDeadError) reports the engine unavailable
    meanwhile; unlike a plain EngineDeadError it passes: the open streams resume, and the
    next check after the restart succeeds."""


class EngineGenerateError(RuntimeError):
    """A failure scoped to one request; the engine keeps serving the others."""


class InvalidRequestError(EngineGenerateError, ValueError):
    """The engine core refused the request as invalid: a rule only the core can check (a
    structured-outputs grammar that does not compile, say) or one a front-end let through. A
    ValueError, as the front-end's own checks raise (the OpenAI server answers 400), and an
    EngineGenerateError: the engine keeps serving the others."""


class EngineOverloadedError(EngineGenerateError):
    """The engine refused a new request at once, without queueing it: its waiting queue is full
    (`max_waiting_requests`) or its core is draining to shut down. Nothing ran, so retrying
    later (or on another engine) may succeed; the OpenAI server answers 503 with Retry-After.
    A subclass of EngineGenerateError (a failure scoped to one request: the engine keeps
    serving), so code that catches that still catches this; catch this first to tell them apart."""
