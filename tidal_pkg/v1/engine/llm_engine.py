"""vLLM's `vllm.v1.engine.llm_engine` names."""
from tidal.frontend.llm import LLMEngine

__all__ = ["LLMEngine"]
