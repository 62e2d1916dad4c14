"""vLLM's `vllm.v1.metrics.reader`: the records `LLM.get_metrics()` returns. The implementation
is tidal.frontend.metrics_reader."""
from tidal.frontend.metrics_reader import Counter, Gauge, Histogram, Metric, Vector, get_metrics_snapshot

__all__ = ["Counter", "Gauge", "Histogram", "Metric", "Vector", "get_metrics_snapshot"]
