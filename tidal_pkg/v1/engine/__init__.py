"""vLLM's `vllm.v1.engine` package path."""
