"""tidal's front-end: AsyncLLM (asyncio), LLM (offline), processors, core clients, CLI.

`AsyncLLM` and `LLM` are imported lazily, so that `tidal.frontend.cli` (and `tidal core`)
start without loading the whole front-end; `EngineArgs`/`AsyncEngineArgs` are light (no torch,
no zmq) and imported at once.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tidal.frontend.engine_args import AsyncEngineArgs, EngineArgs

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.llm import LLM, LLMEngine

__all__ = ["AsyncEngineArgs", "AsyncLLM", "EngineArgs", "LLM", "LLMEngine"]


def __getattr__(name: str) -> Any:
    if name == "AsyncLLM":
        from tidal.frontend.async_llm import AsyncLLM

        return AsyncLLM
    if name in ("LLM", "LLMEngine"):
        from tidal.frontend import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'tidal.frontend' has no attribute {name!r}")
