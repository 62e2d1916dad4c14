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
    from tidal.frontend.chat_utils import (
        ChatTemplateError,
        NoChatTemplateError,
        check_chat_options,
        content_text,
        normalize_messages,
        render_chat,
        resolve_chat_template,
    )
    from tidal.frontend.input_processor import plain_token_ids
    from tidal.frontend.llm import LLM
    from tidal.frontend.llm_engine import LLMEngine
    from tidal.frontend.priority import lower_thread_priority
    from tidal.frontend.prompt_tokens import PromptEncoder, keep_last, truncation_length
    from tidal.frontend.request_ids import RequestIds, random_request_id

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "AsyncLLM": "async_llm", "LLM": "llm", "LLMEngine": "llm_engine",
    # chat messages and their rendering, as LLM.chat does it
    "content_text": "chat_utils", "normalize_messages": "chat_utils", "render_chat": "chat_utils",
    "resolve_chat_template": "chat_utils", "check_chat_options": "chat_utils",
    "ChatTemplateError": "chat_utils", "NoChatTemplateError": "chat_utils",
    "plain_token_ids": "input_processor",  # a token-id prompt's ids, checked
    "lower_thread_priority": "priority",  # the server's loop yields to a CPU engine
    # text prompts to token ids (truncate_prompt_tokens, long texts), as the input processor does it
    "PromptEncoder": "prompt_tokens", "keep_last": "prompt_tokens", "truncation_length": "prompt_tokens",
    "RequestIds": "request_ids", "random_request_id": "request_ids",  # the one request-id scheme
}

__all__ = ["AsyncEngineArgs", "EngineArgs", "config_from_args", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tidal.frontend' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tidal.frontend.{module}"), name)
