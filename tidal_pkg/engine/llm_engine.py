"""vLLM's `vllm.engine.llm_engine` names."""
from tidal.frontend.llm import LLMEngine

__all__ = ["LLMEngine"]
