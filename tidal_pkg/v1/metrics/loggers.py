"""vLLM's `vllm.v1.metrics.loggers`: the stat-logger interface and vLLM's loggers, so a logger
written for vLLM (a `StatLoggerBase` subclass built with `(vllm_config, engine_index)`) runs
unchanged as `AsyncLLM.from_engine_args(..., stat_loggers=[MyLogger])` or `LLM(...,
stat_loggers=[...])`. The implementation is tidal.frontend.metrics."""
from tidal.frontend.metrics import (
    WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED, AggregatedLoggingStatLogger, AggregateStatLoggerBase,
    AggregateStatLoggerFactory, LoggingStatLogger, PerEngineStatLoggerAdapter, PerEngineStatLoggerFactory,
    PrometheusStatLogger, PromMetric, StatLoggerBase, StatLoggerFactory, StatLoggerManager, build_1_2_5_buckets,
    build_buckets, make_per_engine)

__all__ = [
    "WAITING_REASON_CAPACITY", "WAITING_REASON_DEFERRED", "AggregateStatLoggerBase", "AggregateStatLoggerFactory",
    "AggregatedLoggingStatLogger", "LoggingStatLogger", "PerEngineStatLoggerAdapter", "PerEngineStatLoggerFactory",
    "PromMetric", "PrometheusStatLogger", "StatLoggerBase", "StatLoggerFactory", "StatLoggerManager",
    "build_1_2_5_buckets", "build_buckets", "make_per_engine",
]
