"""vLLM's `vllm.usage` package path (usage_lib.UsageContext)."""
