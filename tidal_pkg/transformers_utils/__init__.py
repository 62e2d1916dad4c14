"""vLLM's `vllm.transformers_utils` package path (tokenizer.get_tokenizer)."""
