"""vLLM's `vllm.v1.engine` package path (PauseMode: AsyncLLM.pause_generation's modes)."""
from typing import Any


def __getattr__(name: str) -> Any:
    # Lazy: importing the package path must not load the whole front-end.
    if name == "PauseMode":
        from tidal.frontend.async_llm import PauseMode
        return PauseMode
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
