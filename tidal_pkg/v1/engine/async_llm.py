"""vLLM's `vllm.v1.engine.async_llm` names."""
from tidal.frontend.async_llm import AsyncLLM

__all__ = ["AsyncLLM"]
