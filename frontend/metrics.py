"""Engine metrics: vLLM's metric set in a per-engine Prometheus registry, and its stats log line
(vLLM V1's vllm/v1/metrics/loggers.py).

How a front-end uses it (only when stats are on, i.e. `disable_log_stats=False`):

    metrics = EngineMetrics(model_name, max_model_len)          # one per engine
    # for each EngineCoreOutputs message `msg` from the core:
    it = IterationStats()
    #   for each EngineCoreOutput `out` the output processor accepts, for its (child) request
    #   (it fills `req_stats`, i.e. RequestOutput.metrics: it replaces any other filling of it):
    it.update_from_output(out, msg.timestamp, len(prompt_token_ids), req_stats)
    #   for each (child) request the front-end finishes, after the call above:
    it.update_from_finished_request(reason, len(prompt_token_ids), max_tokens, req_stats,
                                    num_cached_tokens)
    metrics.record(msg.scheduler_stats, it)
    metrics.maybe_log()                     # the one-line summary every `log_interval_s`
    metrics.get_metrics()                   # LLM.get_metrics(): vLLM's records, `vllm:` names
    generate_latest(metrics.registry)       # the server's /metrics, `tidal:` names

What is counted where: tokens (`prompt_tokens`, `prompt_tokens_cached`, `generation_tokens`),
request counts and every histogram come from this front-end's own outputs, so they are exact
for what it served; the gauges (`num_requests_running`, `num_requests_waiting`,
`kv_cache_usage_perc`) and `prefix_cache_queries`, `prefix_cache_hits`, `num_preemptions` are
the core's, as `SchedulerStats` reports them (core-wide: a headless core shared by several
front-ends reports its whole state to each; these counters count from the core's start).
"""
from __future__ import annotations

import asyncio
import bisect
import copy
import logging
import time
from collections.abc import Sequence
from typing import Any

import prometheus_client as prom

from tidal.frontend.metrics_reader import (
    Counter, Gauge, Histogram, Metric, Vector, get_metrics_snapshot)
from tidal.frontend.metrics_stats import (
    CoreCounterDeltas, FinishedRequestStats, IterationStats, StatLoggerBase)
from tidal.protocol.messages import FinishReason, SchedulerStats

# vLLM's public names (the reader's records, the stats, the loggers), all importable from here.
__all__ = [  # noqa: RUF022 - grouped by kind, not sorted
    "Counter", "Gauge", "Histogram", "Metric", "Vector", "get_metrics_snapshot",
    "FinishedRequestStats", "IterationStats", "CoreCounterDeltas", "StatLoggerBase",
    "LoggingStatLogger", "PrometheusStatLogger", "EngineMetrics", "build_buckets", "build_1_2_5_buckets",
]

logger = logging.getLogger(__name__)

# vLLM's bucket boundaries, so dashboards and SLO queries carry over unchanged.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
FINISH_REASONS = tuple(str(r) for r in FinishReason)  # "stop", "length", "abort", "error"
TIDAL_PREFIX = "tidal:"
LABEL_NAMES = ("model_name", "engine")


def build_buckets(mantissas: Sequence[int], max_value: int) -> list[int]:
    """mantissa x 10^k for k = 0, 1, ... while the value is at most `max_value`."""
    buckets: list[int] = []
    scale = 1
    while True:
        for m in mantissas:
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """`build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]` (token-count histograms)."""
    return build_buckets([1, 2, 5], max_value)


class LoggingStatLogger(StatLoggerBase):
    """vLLM's one-line summary, logged by `log()`: throughput over the interval since the last
    log (prompt tokens the core computed, i.e. not from the prefix cache, and generation
    tokens), the latest running/waiting counts and KV usage, the prefix-cache hit rate over the
    interval (the previous rate when the interval had no lookups). At INFO while busy, DEBUG
    once idle, so an idle server's log stays quiet."""

    def __init__(self, engine_index: int = 0, now: float | None = None) -> None:
        self.engine_index = engine_index
        self.last_scheduler_stats = SchedulerStats()
        self.last_prompt_throughput = 0.0
        self.last_generation_throughput = 0.0
        self.prefix_cache_hit_rate = 0.0
        self.last_line = ""
        self._deltas = CoreCounterDeltas()
        self._reset(time.monotonic() if now is None else now)

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_computed_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            deltas = self._deltas.update(scheduler_stats)
            self.num_preemptions += deltas["num_preemptions"]
            self.prefix_cache_queries += deltas["prefix_cache_queries"]
            self.prefix_cache_hits += deltas["prefix_cache_hits"]
            self.last_scheduler_stats = scheduler_stats

    def log(self, now: float | None = None) -> None:
        """Log the line (kept in `last_line`) and start a new interval."""
        now = time.monotonic() if now is None else now
        elapsed = now - self.last_log_time
        prompt_tp = self.num_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_tp = self.num_generation_tokens / elapsed if elapsed > 0 else 0.0
        if self.prefix_cache_queries:
            self.prefix_cache_hit_rate = self.prefix_cache_hits / self.prefix_cache_queries
        idle = not any((prompt_tp, generation_tp, self.last_prompt_throughput, self.last_generation_throughput))
        self.last_prompt_throughput, self.last_generation_throughput = prompt_tp, generation_tp
        self.last_line = self._format_line(prompt_tp, generation_tp)
        self._reset(now)
        logger.log(logging.DEBUG if idle else logging.INFO, "%s", self.last_line)

    def _format_line(self, prompt_tp: float, generation_tp: float) -> str:
        stats = self.last_scheduler_stats
        parts = [f"Engine {self.engine_index:03d}: Avg prompt throughput: {prompt_tp:.1f} tokens/s",
                 f"Avg generation throughput: {generation_tp:.1f} tokens/s",
                 f"Running: {stats.num_running_reqs} reqs", f"Waiting: {stats.num_waiting_reqs} reqs"]
        if self.num_preemptions:  # vLLM shows the field only when there were some
            parts.append(f"Preemptions: {self.num_preemptions}")
        parts.append(f"GPU KV cache usage: {stats.kv_cache_usage * 100:.1f}%")
        parts.append(f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%")
        return ", ".join(parts)


class PrometheusStatLogger(StatLoggerBase):
    """vLLM's metric set, named `prefix + vLLM's name without "vllm:"`, labelled
    `model_name` and `engine`, in its own `CollectorRegistry` (never prometheus_client's
    global one: two engines in one process would collide there)."""

    def __init__(self, model_name: str, max_model_len: int, *, prefix: str = TIDAL_PREFIX,
                 engine_index: int = 0, registry: prom.CollectorRegistry | None = None) -> None:
        self.prefix = prefix
        self.registry = prom.CollectorRegistry() if registry is None else registry
        self._label_values = (model_name, str(engine_index))
        self._deltas = CoreCounterDeltas()
        self._make_scheduler_metrics()
        self._make_token_metrics(build_1_2_5_buckets(max_model_len))
        self._make_latency_metrics()

    # ------------------------------------------------------------------ definitions
    def _gauge(self, name: str, doc: str) -> prom.Gauge:
        return prom.Gauge(self.prefix + name, doc, LABEL_NAMES, registry=self.registry).labels(*self._label_values)

    def _counter(self, name: str, doc: str) -> prom.Counter:
        return prom.Counter(self.prefix + name, doc, LABEL_NAMES, registry=self.registry).labels(*self._label_values)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> prom.Histogram:
        return prom.Histogram(self.prefix + name, doc, LABEL_NAMES, registry=self.registry,
                              buckets=buckets).labels(*self._label_values)

    def _make_scheduler_metrics(self) -> None:
        self.gauge_running = self._gauge("num_requests_running", "Number of requests in model execution batches.")
        self.gauge_waiting = self._gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.gauge_kv_cache_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counter_prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.counter_prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.counter_preemptions = self._counter("num_preemptions", "Cumulative number of preemptions by the engine.")
        # tidal's own: the engine core died and was replaced, its requests resumed
        self.counter_core_restarts = self._counter("num_core_restarts",
                                                   "Cumulative number of engine-core restarts.")

    def _make_token_metrics(self, token_buckets: list[int]) -> None:
        self.counter_prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.counter_prompt_tokens_cached = self._counter(
            "prompt_tokens_cached", "Number of prompt tokens found in the prefix cache.")
        self.counter_generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        success = prom.Counter(self.prefix + "request_success", "Count of successfully processed requests.",
                               LABEL_NAMES + ("finished_reason",), registry=self.registry)
        self._success_family = success
        # Every reason exported from the start (at 0), so a rate over it exists before the first.
        self.counter_request_success = {r: success.labels(*self._label_values, r) for r in FINISH_REASONS}
        self.histogram_prompt_tokens = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.histogram_generation_tokens = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.histogram_prefill_kv_computed = self._histogram(
            "request_prefill_kv_computed_tokens", "New KV tokens computed in prefill (not cached).", token_buckets)
        self.histogram_max_tokens = self._histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets)
        self.histogram_iteration_tokens = self._histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)

    def _make_latency_metrics(self) -> None:
        self.histogram_ttft = self._histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.histogram_itl = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.histogram_tpot = self._histogram(
            "request_time_per_output_token_seconds", "Histogram of mean time per output token per request.",
            ITL_BUCKETS)
        phases = {"e2e_request_latency_seconds": "e2e request latency",
                  "request_queue_time_seconds": "time spent in WAITING phase",
                  "request_inference_time_seconds": "time spent in RUNNING phase",
                  "request_prefill_time_seconds": "time spent in PREFILL phase",
                  "request_decode_time_seconds": "time spent in DECODE phase"}
        self.histogram_phase = {name: self._histogram(name, f"Histogram of {what} in seconds.",
                                                      REQUEST_LATENCY_BUCKETS) for name, what in phases.items()}

    # ------------------------------------------------------------------ recording
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats)
        if iteration_stats is not None:
            self._record_iteration(iteration_stats)
            for finished in iteration_stats.finished_requests:
                self._record_finished(finished)

    def _record_scheduler(self, stats: SchedulerStats) -> None:
        self.gauge_running.set(stats.num_running_reqs)
        self.gauge_waiting.set(stats.num_waiting_reqs)
        self.gauge_kv_cache_usage.set(stats.kv_cache_usage)
        deltas = self._deltas.update(stats)
        self.counter_prefix_cache_queries.inc(deltas["prefix_cache_queries"])
        self.counter_prefix_cache_hits.inc(deltas["prefix_cache_hits"])
        self.counter_preemptions.inc(deltas["num_preemptions"])

    def _record_iteration(self, it: IterationStats) -> None:
        self.counter_prompt_tokens.inc(it.num_prompt_tokens)
        self.counter_prompt_tokens_cached.inc(it.num_cached_prompt_tokens)
        self.counter_generation_tokens.inc(it.num_generation_tokens)
        num_tokens = it.num_prompt_tokens + it.num_generation_tokens
        if num_tokens:  # a record for requests finished outside a step is no step
            self.histogram_iteration_tokens.observe(num_tokens)
        observe_many(self.histogram_ttft, it.time_to_first_tokens_iter)
        observe_many(self.histogram_itl, it.inter_token_latencies_iter)

    def _record_finished(self, f: FinishedRequestStats) -> None:
        counter = self.counter_request_success.get(f.finish_reason)
        if counter is None:  # a reason this build does not know: count it under its own label
            counter = self._success_family.labels(*self._label_values, f.finish_reason)
        counter.inc()
        phase = self.histogram_phase
        phase["e2e_request_latency_seconds"].observe(f.e2e_latency)
        phase["request_queue_time_seconds"].observe(f.queued_time)
        phase["request_inference_time_seconds"].observe(f.inference_time)
        phase["request_prefill_time_seconds"].observe(f.prefill_time)
        phase["request_decode_time_seconds"].observe(f.decode_time)
        self.histogram_prompt_tokens.observe(f.num_prompt_tokens)
        self.histogram_generation_tokens.observe(f.num_generation_tokens)
        self.histogram_prefill_kv_computed.observe(f.num_prompt_tokens - min(f.num_cached_tokens, f.num_prompt_tokens))
        self.histogram_tpot.observe(f.mean_time_per_output_token)
        if f.max_tokens_param:
            self.histogram_max_tokens.observe(f.max_tokens_param)


def observe_many(histogram: prom.Histogram, values: Sequence[float]) -> None:
    """`histogram.observe(v)` for each of `values`, with one lock per touched bucket instead of
    two per value: a streaming server observes an inter-token latency per token, and one
    observe (~2 us) was ~3% of its front-end CPU per chunk. Uses the child's value cells
    (prometheus_client's layout since 0.4; tests/test_metrics.py checks the exposition against
    plain observe); falls back to observe() where they are missing."""
    if not values:
        return
    bounds: list[float] | None = getattr(histogram, "_upper_bounds", None)
    cells = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or cells is None or total is None or len(cells) != len(bounds):
        for v in values:
            histogram.observe(v)
        return
    counts = [0] * len(bounds)
    for v in values:
        if v == v:  # NaN fits no bucket (observe's `amount <= bound` is never true); it still sums
            counts[bisect.bisect_left(bounds, v)] += 1  # the first bound >= v, as observe's scan
    total.inc(sum(values))
    for i, n in enumerate(counts):
        if n:
            cells[i].inc(n)


class EngineMetrics:
    """One engine's metrics: the Prometheus metric set (`registry`, under `prefix`), the
    one-line stats log, and any extra `StatLoggerBase` (a user's `stat_loggers`), all fed by
    `record`. See the module docstring for the calls a front-end makes."""

    def __init__(self, model_name: str, max_model_len: int, *, prefix: str = TIDAL_PREFIX,
                 engine_index: int = 0, log_interval_s: float = 10.0,
                 stat_loggers: Sequence[StatLoggerBase] = ()) -> None:
        self.prometheus = PrometheusStatLogger(model_name, max_model_len, prefix=prefix, engine_index=engine_index)
        self.logging = LoggingStatLogger(engine_index)
        self.user_loggers: list[StatLoggerBase] = list(stat_loggers)
        self.log_interval_s = log_interval_s
        self._next_log = time.monotonic() + log_interval_s
        self._failed: set[int] = set()  # id() of each user logger whose first failure was logged

    @property
    def registry(self) -> prom.CollectorRegistry:
        """For the server: `prometheus_client.generate_latest(metrics.registry)`."""
        return self.prometheus.registry

    @property
    def prefix(self) -> str:
        return self.prometheus.prefix

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None) -> None:
        """Once per `EngineCoreOutputs` message (its `scheduler_stats`, None when it had none),
        and with `scheduler_stats=None` for requests finished outside a step (user aborts)."""
        self.prometheus.record(scheduler_stats, iteration_stats)
        self.logging.record(scheduler_stats, iteration_stats)
        for stat_logger in self.user_loggers:
            # Each user logger gets copies: one that edits its stats (or keeps and edits them
            # later) cannot change what the built-in loggers hold, or what another logger sees.
            self._call_user_logger(stat_logger, "record", copy.deepcopy(scheduler_stats),
                                   copy.deepcopy(iteration_stats))

    def record_core_restart(self) -> None:
        self.prometheus.counter_core_restarts.inc()

    def log(self) -> None:
        """Every logger's periodic output now (vLLM's `do_log_stats()`)."""
        self._next_log = time.monotonic() + self.log_interval_s
        self.prometheus.log()
        self.logging.log()
        for stat_logger in self.user_loggers:
            self._call_user_logger(stat_logger, "log")

    def _call_user_logger(self, stat_logger: StatLoggerBase, method: str, *args: Any) -> None:
        """A user's stat logger that raises loses that call, never the engine: these calls run
        in the front-end's output handler (LLM's step loop), where an exception would end every
        stream. Its first failure is logged with the traceback; it is still called after.
        A CancelledError raised inside this synchronous call is the logger's own (a real
        cancellation of the output handler arrives at an await, never in here): caught too."""
        try:
            getattr(stat_logger, method)(*args)
        except (Exception, asyncio.CancelledError):
            if id(stat_logger) not in self._failed:
                self._failed.add(id(stat_logger))
                logger.exception("stat logger %s failed in %s() (its later failures are not logged)",
                                 type(stat_logger).__name__, method)

    def seconds_until_log(self, now: float | None = None) -> float:
        """How long until `maybe_log` logs (0.0 once it is due)."""
        return max(0.0, self._next_log - (time.monotonic() if now is None else now))

    def maybe_log(self, now: float | None = None) -> bool:
        """`log()` if `log_interval_s` has passed since the last one; cheap enough to call
        after every step (the sync `LLM` has no timer task). Returns whether it logged."""
        if (time.monotonic() if now is None else now) < self._next_log:
            return False
        self.log()
        return True

    def get_metrics(self) -> list[Metric]:
        """vLLM's `LLM.get_metrics()`: every metric as a reader record named `vllm:...`."""
        return get_metrics_snapshot(self.registry, self.prefix)
