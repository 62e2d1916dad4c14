"""vLLM's `vllm.v1.metrics` package path: `loggers` (the stat logger classes), `stats` (what
they are given), `reader` (`LLM.get_metrics()`'s records)."""
