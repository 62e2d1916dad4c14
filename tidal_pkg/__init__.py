"""tidal: an LLM inference engine.

vLLM's top-level names, so that `from vllm import LLM, SamplingParams` becomes
`from tidal import LLM, SamplingParams`. They load on first use (PEP 562): `import tidal.core`
in an engine process must not pull in the front-end.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from tidal.frontend import AsyncEngineArgs, AsyncLLM, EngineArgs, LLM, LLMEngine
    from tidal.protocol import (BeamSearchParams, CompletionOutput, RequestOutput, RequestOutputKind,
                                SamplingParams, StructuredOutputsParams)
    from tidal.protocol.inputs import PromptType, TextPrompt, TokensPrompt

_EXPORTS = {
    "LLM": "tidal.frontend", "LLMEngine": "tidal.frontend", "AsyncLLM": "tidal.frontend",
    "EngineArgs": "tidal.frontend", "AsyncEngineArgs": "tidal.frontend",
    "SamplingParams": "tidal.protocol", "RequestOutputKind": "tidal.protocol",
    "RequestOutput": "tidal.protocol", "CompletionOutput": "tidal.protocol",
    "BeamSearchParams": "tidal.protocol", "StructuredOutputsParams": "tidal.protocol",
    "TextPrompt": "tidal.protocol.inputs", "TokensPrompt": "tidal.protocol.inputs",
    "PromptType": "tidal.protocol.inputs",
}
_ALIASES = {"AsyncLLMEngine": "AsyncLLM"}  # vLLM V1's AsyncLLMEngine is its AsyncLLM

__all__ = ["__version__", *_EXPORTS, *_ALIASES]


def __getattr__(name: str) -> Any:
    target = _ALIASES.get(name, name)
    module = _EXPORTS.get(target)
    if module is None:
        raise AttributeError(f"module 'tidal' has no attribute {name!r}")
    return getattr(importlib.import_module(module), target)
