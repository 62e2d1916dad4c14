"""tidal's front-end: AsyncLLM (asyncio), LLM (offline), processors, core clients, CLI.

`AsyncLLM` and `LLM` are imported lazily, so that `tidal.frontend.cli` (and `tidal core`)
start without loading the whole front-end.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.llm import LLM

__all__ = ["AsyncLLM", "LLM"]


def __getattr__(name: str) -> Any:
    if name == "AsyncLLM":
        from tidal.frontend.async_llm import AsyncLLM

        return AsyncLLM
    if name == "LLM":
        from tidal.frontend.llm import LLM

        return LLM
    raise AttributeError(f"module 'tidal.frontend' has no attribute {name!r}")
