"""vLLM's `vllm.v1.engine.llm_engine` names."""
from tidal.frontend.llm_engine import LLMEngine

__all__ = ["LLMEngine"]
