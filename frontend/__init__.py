"""tidal's client library: AsyncLLM (asyncio), LLM (offline), engine args, processors, core
clients and their recovery. The applications built on it (the CLI, the OpenAI server, the
checkpoint maker) live in `tidal.frontend.entrypoints` and import only the names below.

Everything but the engine args is imported lazily, so that the CLI (and `tidal core`) start
without loading the whole front-end; `EngineArgs`/`AsyncEngineArgs` are light (no torch, no
zmq) and imported at once.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tidal.frontend.engine_args import AsyncEngineArgs, EngineArgs, config_from_args

if TYPE_CHECKING:
    from tidal.frontend.async_llm import AsyncLLM
    from tidal.frontend.chat_utils import content_text, normalize_messages
    from tidal.frontend.input_processor import plain_token_ids
    from tidal.frontend.llm import LLM, LLMEngine
    from tidal.frontend.priority import lower_thread_priority
    from tidal.frontend.tokenizer import LONG_TEXT_CHARS, check_prompt_chars, prompt_char_limit

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "AsyncLLM": "async_llm", "LLM": "llm", "LLMEngine": "llm",
    "content_text": "chat_utils", "normalize_messages": "chat_utils",  # chat message handling
    "plain_token_ids": "input_processor",  # a token-id prompt's ids, checked
    "lower_thread_priority": "priority",  # the server's loop yields to a CPU engine
    "LONG_TEXT_CHARS": "tokenizer", "check_prompt_chars": "tokenizer", "prompt_char_limit": "tokenizer",
}

__all__ = ["AsyncEngineArgs", "EngineArgs", "config_from_args", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.frontend' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tidal.frontend.{module}"), name)
