"""vLLM's `vllm.v1.metrics.stats`: what the stat loggers are given (not a stable interface, in
vLLM either). The implementation is tidal.frontend.metrics_stats."""
from tidal.frontend.metrics_stats import FinishedRequestStats, IterationStats, PromptTokenStats
from tidal.protocol.messages import SchedulerStats
from tidal.protocol.outputs import RequestStateStats

__all__ = ["FinishedRequestStats", "IterationStats", "PromptTokenStats", "RequestStateStats", "SchedulerStats"]
