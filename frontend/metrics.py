"""Engine metrics: vLLM's metric set in a per-engine Prometheus registry, its stats log line,
and its stat-logger classes (vLLM V1's vllm/v1/metrics/loggers.py; `tidal.v1.metrics.loggers`;
the log-line loggers live in metrics_logging.py and are re-exported here; the holders,
StatLoggerManager and EngineMetrics, in metrics_manager.py).

How a front-end uses it (only when stats are on, i.e. `disable_log_stats=False`):

    metrics = EngineMetrics(model_name, max_model_len, vllm_config=config,   # one per engine
                            stat_loggers=[make(config, 0) for make in factories])
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
    generate_latest(metrics.registry)       # the server's /metrics

Names: vLLM's own (`vllm:num_requests_running`, ...), labelled `model_name` and `engine`, so
dashboards built for vLLM read tidal unchanged; what vLLM has no metric for is tidal's and says
so (`tidal:num_core_restarts`).

What is counted where: tokens (`prompt_tokens`, `prompt_tokens_cached`, `generation_tokens`),
request counts and every histogram come from this front-end's own outputs, so they are exact
for what it served; the gauges (`num_requests_running`, `num_requests_waiting`,
`kv_cache_usage_perc`) and `prefix_cache_queries`, `prefix_cache_hits`, `num_preemptions` and
the speculative-decoding counters are the core's, as `SchedulerStats` reports them (core-wide:
a headless core shared by several front-ends reports its whole state to each; these counters
count from the core's start).
"""
from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import Any, TypeAlias

import prometheus_client as prom

from tidal.frontend.metrics_logging import (
    AggregatedLoggingStatLogger, LoggingStatLogger, PerEngineStatLoggerAdapter, PerEngineStatLoggerFactory)
from tidal.frontend.metrics_reader import (
    VLLM_PREFIX, Counter, Gauge, Histogram, Metric, Vector, get_metrics_snapshot)
from tidal.frontend.metrics_stats import (
    AggregateStatLoggerBase, CoreCounterDeltas, FinishedRequestStats, IterationStats, PromptTokenStats,
    StatLoggerBase)
from tidal.protocol.messages import FinishReason, SchedulerStats

# vLLM's public names (the reader's records, the stats, the loggers), all importable from here.
__all__ = [  # noqa: RUF022 - grouped by kind, not sorted
    "Counter", "Gauge", "Histogram", "Metric", "Vector", "get_metrics_snapshot",
    "FinishedRequestStats", "IterationStats", "PromptTokenStats", "CoreCounterDeltas",
    "StatLoggerBase", "AggregateStatLoggerBase", "LoggingStatLogger", "AggregatedLoggingStatLogger",
    "PerEngineStatLoggerAdapter", "PrometheusStatLogger", "StatLoggerManager", "StatLoggerFactory",
    "PerEngineStatLoggerFactory", "AggregateStatLoggerFactory", "EngineMetrics", "build_buckets",
    "build_1_2_5_buckets", "VLLM_PREFIX", "TIDAL_PREFIX", "WAITING_REASON_CAPACITY", "WAITING_REASON_DEFERRED",
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
REQUEST_N_BUCKETS = [1, 2, 5, 10, 20]
# vLLM's `finished_reason` values, every one exported from the start (tidal never finishes a
# request for "repetition", vLLM's repetition detection: that series stays 0).
FINISH_REASONS = tuple(dict.fromkeys([*(str(r) for r in FinishReason), "stop", "length", "abort", "error",
                                      "repetition"]))
TIDAL_PREFIX = "tidal:"  # tidal's own metrics, those vLLM has none for
LABEL_NAMES = ("model_name", "engine")
# Several API server processes (prometheus_client's multiprocess mode, set by
# frontend/entrypoints/api_servers.py): counters and histograms are summed over them; a gauge is
# one engine's state as each server last heard it, so the most recent value stands.
MULTIPROC_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
GAUGE_MODE = "mostrecent"
# vLLM's `reason` label values of vllm:num_requests_waiting_by_reason.
WAITING_REASON_CAPACITY = "capacity"  # waiting for room (KV blocks, max_num_seqs, token budget)
WAITING_REASON_DEFERRED = "deferred"  # held back by something passing (a grammar still compiling)
SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")  # vLLM's `sleep_state` label values

AggregateStatLoggerFactory: TypeAlias = type[AggregateStatLoggerBase]
StatLoggerFactory: TypeAlias = AggregateStatLoggerFactory | PerEngineStatLoggerFactory


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


class PrometheusStatLogger(AggregateStatLoggerBase):
    """vLLM's metric set, named `prefix` + vLLM's name without "vllm:" (vLLM's own names by
    default), labelled `model_name` and `engine` (one child per engine of `engine_indexes`), in
    its own `CollectorRegistry` (never prometheus_client's global one: two engines in one
    process would collide there). Built vLLM's way, `(vllm_config, engine_indexes)`, or, by
    tidal's front-end, from `model_name` and `max_model_len` alone (then `cache_config_info`
    has no config to show and is left out)."""

    def __init__(self, vllm_config: Any = None, engine_indexes: list[int] | None = None, *,  # type: ignore[override]
                 model_name: str | None = None, max_model_len: int | None = None, prefix: str = VLLM_PREFIX,
                 registry: prom.CollectorRegistry | None = None) -> None:
        self.vllm_config = vllm_config
        self.engine_indexes = [0] if engine_indexes is None else list(engine_indexes)
        if model_name is None or max_model_len is None:
            if vllm_config is None:
                raise ValueError("PrometheusStatLogger needs a vllm_config, or model_name and max_model_len")
            model_config = vllm_config.model_config
            model_name = model_config.served_model_name if model_name is None else model_name
            max_model_len = model_config.max_model_len if max_model_len is None else max_model_len
        self.model_name = str(model_name)
        self.prefix = prefix
        self.registry = prom.CollectorRegistry() if registry is None else registry
        self._label_values = {i: (self.model_name, str(i)) for i in self.engine_indexes}
        self._deltas = {i: CoreCounterDeltas() for i in self.engine_indexes}
        self._cache_config_info: prom.Gauge | None = None
        self._spec_decode: dict[str, Any] | None = None
        self._make_scheduler_metrics()
        self._make_token_metrics(build_1_2_5_buckets(int(max_model_len)))
        self._make_latency_metrics()
        if getattr(vllm_config, "speculative_config", None) is not None:
            self._make_spec_decode_metrics()

    # ------------------------------------------------------------------ definitions
    def _per_engine(self, family: Any) -> dict[int, Any]:
        return {i: family.labels(*values) for i, values in self._label_values.items()}

    def _gauge(self, name: str, doc: str) -> dict[int, prom.Gauge]:
        return self._per_engine(prom.Gauge(self.prefix + name, doc, LABEL_NAMES, registry=self.registry,
                                           multiprocess_mode=GAUGE_MODE))

    def _counter(self, name: str, doc: str, prefix: str | None = None) -> dict[int, prom.Counter]:
        name = (self.prefix if prefix is None else prefix) + name
        return self._per_engine(prom.Counter(name, doc, LABEL_NAMES, registry=self.registry))

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> dict[int, prom.Histogram]:
        return self._per_engine(prom.Histogram(self.prefix + name, doc, LABEL_NAMES, registry=self.registry,
                                               buckets=buckets))

    def _labelled(self, kind: type, name: str, doc: str, label: str,
                  values: Sequence[str]) -> dict[str, dict[int, Any]]:
        """A metric with one more label than `model_name`, `engine`: {value: {engine: child}},
        every value exported from the start (at 0), so a rate over it exists before the first."""
        mode = {"multiprocess_mode": GAUGE_MODE} if kind is prom.Gauge else {}
        family = kind(self.prefix + name, doc, LABEL_NAMES + (label,), registry=self.registry, **mode)
        return {v: {i: family.labels(*lv, v) for i, lv in self._label_values.items()} for v in values}

    def _make_scheduler_metrics(self) -> None:
        self.gauge_scheduler_running = self._gauge("num_requests_running",
                                                   "Number of requests in model execution batches.")
        self.gauge_scheduler_waiting = self._gauge("num_requests_waiting",
                                                   "Number of requests waiting to be processed.")
        self.gauge_waiting_by_reason = self._labelled(
            prom.Gauge, "num_requests_waiting_by_reason",
            "Number of waiting requests by reason: 'capacity' = waiting for scheduling capacity; 'deferred' = "
            "held back by a passing constraint (a grammar still compiling). They sum to vllm:num_requests_waiting.",
            "reason", (WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED))
        self.gauge_engine_sleep_state = self._labelled(
            prom.Gauge, "engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is awake; "
            "weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
            "sleep_state", SLEEP_STATES)
        self.record_sleep_state()  # tidal's engine never sleeps: awake from the start
        self.gauge_kv_cache_usage = self._gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.counter_prefix_cache_queries = self._counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.")
        self.counter_prefix_cache_hits = self._counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        # No KV connector and no multi-modal inputs in tidal: these stay 0, as vLLM's do without them.
        self.counter_connector_prefix_cache_queries = self._counter(
            "external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing, in tokens.")
        self.counter_connector_prefix_cache_hits = self._counter(
            "external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing, in tokens.")
        self.counter_mm_cache_queries = self._counter(
            "mm_cache_queries", "Multi-modal cache queries, in terms of number of queried items.")
        self.counter_mm_cache_hits = self._counter(
            "mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.")
        self.counter_num_preempted_reqs = self._counter(
            "num_preemptions", "Cumulative number of preemption from the engine.")
        # tidal's own (vLLM has no such metric): the engine core died and was replaced, its requests resumed
        self.counter_core_restarts = self._counter(
            "num_core_restarts", "Cumulative number of engine-core restarts.", prefix=TIDAL_PREFIX)

    def _make_token_metrics(self, token_buckets: list[int]) -> None:
        self.counter_prompt_tokens = self._counter("prompt_tokens", "Number of prefill tokens processed.")
        self.counter_prompt_tokens_by_source = self._labelled(
            prom.Counter, "prompt_tokens_by_source", "Number of prompt tokens by source.", "source",
            PromptTokenStats.ALL_SOURCES)
        self.counter_prompt_tokens_cached = self._counter(
            "prompt_tokens_cached", "Number of cached prompt tokens (local + external).")
        self.counter_generation_tokens = self._counter("generation_tokens", "Number of generation tokens processed.")
        self._success_family = prom.Counter(self.prefix + "request_success",
                                            "Count of successfully processed requests.",
                                            LABEL_NAMES + ("finished_reason",), registry=self.registry)
        self.counter_request_success = {
            r: {i: self._success_family.labels(*lv, r) for i, lv in self._label_values.items()} for r in FINISH_REASONS}
        self.histogram_num_prompt_tokens_request = self._histogram(
            "request_prompt_tokens", "Number of prefill tokens processed.", token_buckets)
        self.histogram_num_generation_tokens_request = self._histogram(
            "request_generation_tokens", "Number of generation tokens processed.", token_buckets)
        self.histogram_iteration_tokens = self._histogram(
            "iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS)
        self.histogram_max_num_generation_tokens_request = self._histogram(
            "request_max_num_generation_tokens", "Histogram of maximum number of requested generation tokens.",
            token_buckets)
        self.histogram_n_request = self._histogram(
            "request_params_n", "Histogram of the n request parameter.", REQUEST_N_BUCKETS)
        self.histogram_max_tokens_request = self._histogram(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets)
        self.histogram_prefill_kv_computed_request = self._histogram(
            "request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).", token_buckets)

    def _make_latency_metrics(self) -> None:
        self.histogram_time_to_first_token = self._histogram(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.histogram_inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.histogram_request_time_per_output_token = self._histogram(
            "request_time_per_output_token_seconds", "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS)
        phases = {"e2e_request_latency_seconds": "Histogram of e2e request latency in seconds.",
                  "request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
                  "request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
                  "request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
                  "request_decode_time_seconds": "Histogram of time spent in DECODE phase for request."}
        self.histogram_phase = {name: self._histogram(name, doc, REQUEST_LATENCY_BUCKETS)
                                for name, doc in phases.items()}

    def _make_spec_decode_metrics(self) -> None:
        """vLLM's speculative-decoding counters (there only when speculation is on; acceptance
        rate = rate(accepted_tokens) / rate(draft_tokens)). Made when the config says
        speculation is on, or at the first stats that show drafts (no config given)."""
        if self._spec_decode is not None:
            return
        per_pos = prom.Counter(self.prefix + "spec_decode_num_accepted_tokens_per_pos",
                               "Accepted tokens per draft position.", LABEL_NAMES + ("position",),
                               registry=self.registry)
        self._spec_decode = {
            "spec_decode_num_drafts": self._counter("spec_decode_num_drafts", "Number of spec decoding drafts."),
            "spec_decode_num_draft_tokens": self._counter("spec_decode_num_draft_tokens", "Number of draft tokens."),
            "spec_decode_num_accepted_tokens": self._counter(
                "spec_decode_num_accepted_tokens", "Number of accepted tokens."),
            "per_pos": per_pos, "per_pos_children": {i: [] for i in self.engine_indexes},
        }
        num_positions = getattr(getattr(self.vllm_config, "speculative_config", None), "num_speculative_tokens", 0)
        for i in self.engine_indexes:
            self._spec_decode_position(i, (num_positions or 0) - 1)

    def _spec_decode_position(self, engine_idx: int, position: int) -> list[prom.Counter]:
        assert self._spec_decode is not None
        children = self._spec_decode["per_pos_children"].setdefault(engine_idx, [])
        while len(children) <= position:
            children.append(self._spec_decode["per_pos"].labels(*self._label_values[engine_idx], str(len(children))))
        return children

    def log_metrics_info(self, type: str, config_obj: Any) -> None:  # noqa: A002 - vLLM's name
        """vLLM's info-style gauge (permanently 1) with a config's fields as labels, plus `engine`."""
        if type != "cache_config":
            raise ValueError(f"Unknown metrics info type {type}")
        info = cache_config_metrics_info(config_obj)
        gauge = prom.Gauge(self.prefix + "cache_config_info", "Information of the LLMEngine CacheConfig",
                           [*info, "engine"], registry=self.registry, multiprocess_mode=GAUGE_MODE)
        for i in self.engine_indexes:
            gauge.labels(**info, engine=str(i)).set(1)
        self._cache_config_info = gauge

    def log_engine_initialized(self) -> None:
        """vLLM's: export `cache_config_info` (once, and only with a config to show)."""
        cache_config = getattr(self.vllm_config, "cache_config", None)
        if cache_config is not None and self._cache_config_info is None:
            self.log_metrics_info("cache_config", cache_config)

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        """vLLM's: sleep 0 = awake; sleep 1 at level 1 = weights offloaded, level 2 = all discarded."""
        values = {"awake": int(sleep != 1), "weights_offloaded": int(sleep == 1 and level == 1),
                  "discard_all": int(sleep == 1 and level == 2)}
        for state, value in values.items():
            for gauge in self.gauge_engine_sleep_state[state].values():
                gauge.set(value)

    def record_core_restart(self, engine_idx: int = 0) -> None:
        self.counter_core_restarts[engine_idx].inc()

    # ------------------------------------------------------------------ recording
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        if engine_idx not in self._label_values:
            logger.warning("Unexpected engine_idx: %d", engine_idx)
            return
        if scheduler_stats is not None:
            self._record_scheduler(scheduler_stats, engine_idx)
        if mm_cache_stats is not None:
            self.counter_mm_cache_queries[engine_idx].inc(getattr(mm_cache_stats, "queries", 0))
            self.counter_mm_cache_hits[engine_idx].inc(getattr(mm_cache_stats, "hits", 0))
        if iteration_stats is not None:
            self._record_iteration(iteration_stats, engine_idx)
            for finished in iteration_stats.finished_requests:
                self._record_finished(finished, engine_idx)

    def _record_scheduler(self, stats: SchedulerStats, i: int) -> None:
        # tidal's num_waiting_reqs counts every waiting request; those of them held back for a
        # passing reason are `num_skipped_waiting_reqs` where the core reports it (vLLM's
        # num_waiting_reqs is the capacity part only, its total waiting + skipped).
        waiting = stats.num_waiting_reqs
        deferred = min(max(int(getattr(stats, "num_skipped_waiting_reqs", 0) or 0), 0), waiting)
        self.gauge_scheduler_running[i].set(stats.num_running_reqs)
        self.gauge_scheduler_waiting[i].set(waiting)
        self.gauge_waiting_by_reason[WAITING_REASON_CAPACITY][i].set(waiting - deferred)
        self.gauge_waiting_by_reason[WAITING_REASON_DEFERRED][i].set(deferred)
        self.gauge_kv_cache_usage[i].set(stats.kv_cache_usage)
        counters = self._deltas[i]
        deltas = counters.update(stats)
        self.counter_prefix_cache_queries[i].inc(deltas["prefix_cache_queries"])
        self.counter_prefix_cache_hits[i].inc(deltas["prefix_cache_hits"])
        self.counter_num_preempted_reqs[i].inc(deltas["num_preemptions"])
        if self._spec_decode is None and (deltas["spec_decode_num_drafts"] or counters.accepted_per_pos):
            self._make_spec_decode_metrics()
        if self._spec_decode is not None:
            for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
                self._spec_decode[name][i].inc(deltas[name])
            children = self._spec_decode_position(i, len(counters.accepted_per_pos) - 1)
            for child, n in zip(children, counters.accepted_per_pos):
                child.inc(n)

    def _record_iteration(self, it: IterationStats, i: int) -> None:
        self.counter_prompt_tokens[i].inc(it.num_prompt_tokens)
        pts = it.prompt_token_stats
        for source in PromptTokenStats.ALL_SOURCES:
            if n := pts.get_by_source(source):  # (an inc takes a lock: none for nothing)
                self.counter_prompt_tokens_by_source[source][i].inc(n)
        if pts.cached_tokens:
            self.counter_prompt_tokens_cached[i].inc(pts.cached_tokens)
        self.counter_generation_tokens[i].inc(it.num_generation_tokens)
        num_tokens = pts.computed + it.num_generation_tokens  # as vLLM: the prompt tokens computed
        if num_tokens:  # a record for requests finished outside a step is no step
            self.histogram_iteration_tokens[i].observe(num_tokens)
        observe_many(self.histogram_max_num_generation_tokens_request[i], it.max_num_generation_tokens_iter)
        observe_many(self.histogram_n_request[i], it.n_params_iter)
        observe_many(self.histogram_time_to_first_token[i], it.time_to_first_tokens_iter)
        observe_many(self.histogram_inter_token_latency[i], it.inter_token_latencies_iter)

    def _record_finished(self, f: FinishedRequestStats, i: int) -> None:
        by_engine = self.counter_request_success.get(f.finish_reason)
        if by_engine is None:  # a reason this build does not know: count it under its own label
            self._success_family.labels(*self._label_values[i], f.finish_reason).inc()
        else:
            by_engine[i].inc()
        phase = self.histogram_phase
        phase["e2e_request_latency_seconds"][i].observe(f.e2e_latency)
        phase["request_queue_time_seconds"][i].observe(f.queued_time)
        phase["request_inference_time_seconds"][i].observe(f.inference_time)
        phase["request_prefill_time_seconds"][i].observe(f.prefill_time)
        phase["request_decode_time_seconds"][i].observe(f.decode_time)
        self.histogram_num_prompt_tokens_request[i].observe(f.num_prompt_tokens)
        self.histogram_num_generation_tokens_request[i].observe(f.num_generation_tokens)
        self.histogram_prefill_kv_computed_request[i].observe(
            f.num_prompt_tokens - min(f.num_cached_tokens, f.num_prompt_tokens))
        self.histogram_request_time_per_output_token[i].observe(f.mean_time_per_output_token)
        if f.max_tokens_param:
            self.histogram_max_tokens_request[i].observe(f.max_tokens_param)


def cache_config_metrics_info(cache_config: Any) -> dict[str, str]:
    """vLLM's `CacheConfig.metrics_info()`: each field as a string label value. tidal's
    CacheConfig view has a subset of vLLM's fields; the ones vLLM's tests name that it lacks
    get the value vLLM shows for them when unused (no CPU blocks, no swap, no sliding window)."""
    info_method = getattr(cache_config, "metrics_info", None)
    if callable(info_method):
        return {str(k): str(v) for k, v in info_method().items()}
    fields = {k: v for k, v in vars(cache_config).items() if not k.startswith("_")}
    fields.setdefault("num_cpu_blocks", None)
    fields.setdefault("sliding_window", None)
    fields.setdefault("swap_space_bytes", float(fields.get("swap_space") or 0.0) * (1 << 30))
    return {k: str(v) for k, v in sorted(fields.items())}


PromMetric: TypeAlias = prom.Gauge | prom.Counter | prom.Histogram


def make_per_engine(metric: Any, engine_idxs: list[int], model_name: object) -> dict[int, Any]:
    """vLLM's helper: the metric's child per engine, labelled (model_name, engine)."""
    return {i: metric.labels(model_name, str(i)) for i in engine_idxs}


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


def __getattr__(name: str) -> Any:
    """The engine-level holders (StatLoggerManager, EngineMetrics) live in metrics_manager.py,
    which builds on this module: importable from here as vLLM's layout has them."""
    if name in ("StatLoggerManager", "EngineMetrics"):
        from tidal.frontend import metrics_manager

        return getattr(metrics_manager, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
