"""Errors users catch, named as in vLLM."""


class EngineDeadError(RuntimeError):
    """The engine core (or one of its workers) is gone; every call fails with this from now on."""

    def __init__(self, message: str = "Engine core is dead; see the log for the original error.") -> None:
        super().__init__(message)


class EngineGenerateError(RuntimeError):
    """A failure scoped to one request; the engine keeps serving the others."""
