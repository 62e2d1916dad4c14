"""vLLM's `vllm.engine` package path (`tidal.engine.arg_utils`)."""
