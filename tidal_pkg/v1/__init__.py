"""vLLM's `vllm.v1` package path, for `from tidal.v1.engine.async_llm import AsyncLLM`."""
