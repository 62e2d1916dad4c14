"""Engine metrics (frontend/metrics*.py) driven with hand-built core outputs and stats at known
times: exact counters, histogram counts/sums/buckets, gauges, labels, vLLM names in
get_metrics(), the prefix in the Prometheus exposition, two engines kept apart."""
from __future__ import annotations

import logging
import time

import prometheus_client
import pytest

from tidal.frontend.metrics import (
    Counter, EngineMetrics, Gauge, Histogram, IterationStats, LoggingStatLogger, Metric,
    StatLoggerBase, build_1_2_5_buckets)
from tidal.protocol.messages import EngineCoreEventType, EngineCoreOutput, FinishReason, SchedulerStats
from tidal.protocol.outputs import RequestStateStats

QUEUED, SCHEDULED, PREEMPTED = (int(e) for e in EngineCoreEventType)
ARRIVAL = 1_000.0  # wall clock of every request's arrival (front-end)
MAX_MODEL_LEN = 100


def _out(rid: str, tokens: list[int], *, events: list[tuple[int, float]] | None = None,
         finish: FinishReason | None = None, cached: int = 0) -> EngineCoreOutput:
    return EngineCoreOutput(rid, new_token_ids=tokens, events=events, finish_reason=finish,
                            num_cached_tokens=cached)


def _find(metrics: list[Metric], name: str, **labels: str) -> list[Metric]:
    return [m for m in metrics if m.name == name and all(m.labels.get(k) == v for k, v in labels.items())]


def _one(metrics: list[Metric], name: str, **labels: str) -> Metric:
    found = _find(metrics, name, **labels)
    assert len(found) == 1, (name, found)
    return found[0]


def _value(metrics: list[Metric], name: str, **labels: str) -> float:
    metric = _one(metrics, name, **labels)
    assert isinstance(metric, (Counter, Gauge))
    return metric.value


def _histogram(metrics: list[Metric], name: str) -> Histogram:
    metric = _one(metrics, name)
    assert isinstance(metric, Histogram)
    return metric


class _Engine:
    """A front-end's view in miniature: per-request stats and prompt lengths, one
    IterationStats per core message, fed the way the output processor will feed them."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.metrics = metrics
        self.stats: dict[str, RequestStateStats] = {}
        self.prompt_len: dict[str, int] = {}
        self.cached: dict[str, int] = {}  # as RequestState.num_cached_tokens: the latest non-zero

    def add(self, rid: str, prompt_len: int) -> None:
        self.stats[rid] = RequestStateStats(arrival_time=ARRIVAL)
        self.prompt_len[rid] = prompt_len

    def step(self, outputs: list[EngineCoreOutput], core_ts: float, wall: float,
             sched: SchedulerStats | None = None, max_tokens: int | None = 16) -> IterationStats:
        it = IterationStats(iteration_timestamp=wall)
        for out in outputs:
            stats = self.stats[out.request_id]
            if out.num_cached_tokens:
                self.cached[out.request_id] = out.num_cached_tokens
            it.update_from_output(out, core_ts, self.prompt_len[out.request_id], stats)
            if out.finish_reason is not None:
                it.update_from_finished_request(out.finish_reason, self.prompt_len[out.request_id],
                                                max_tokens, stats, self.cached.get(out.request_id, 0))
        self.metrics.record(sched, it)
        return it


@pytest.fixture()
def engine() -> _Engine:
    return _Engine(EngineMetrics("tiny", MAX_MODEL_LEN))


def test_token_counters_count_each_token_once(engine: _Engine) -> None:
    engine.add("a", 10)
    engine.add("b", 7)
    engine.step([_out("b", [])], 50.0, ARRIVAL + 0.1)  # a prompt-logprobs chunk: no token yet
    engine.step([_out("a", [1], cached=4)], 50.1, ARRIVAL + 0.2)
    engine.step([_out("a", [2]), _out("b", [3, 4], cached=0)], 50.2, ARRIVAL + 0.3)
    engine.step([_out("a", [5], finish=FinishReason.LENGTH), _out("b", [6], finish=FinishReason.STOP)],
                50.3, ARRIVAL + 0.4)
    m = engine.metrics.get_metrics()
    assert _value(m, "vllm:prompt_tokens") == 17  # each prompt once, at its first token
    assert _value(m, "vllm:prompt_tokens_cached") == 4
    assert _value(m, "vllm:generation_tokens") == 6
    assert _value(m, "vllm:request_success", finished_reason="length") == 1
    assert _value(m, "vllm:request_success", finished_reason="stop") == 1
    assert _value(m, "vllm:request_success", finished_reason="abort") == 0
    assert _value(m, "vllm:request_success", finished_reason="error") == 0
    gen = _histogram(m, "vllm:request_generation_tokens")
    assert (gen.count, gen.sum) == (2, 6)
    assert gen.buckets["2.0"] == 0 and gen.buckets["5.0"] == 2 and gen.buckets["+Inf"] == 2
    prompt = _histogram(m, "vllm:request_prompt_tokens")
    assert (prompt.count, prompt.sum) == (2, 17)
    assert prompt.buckets["5.0"] == 0 and prompt.buckets["10.0"] == 2
    kv_computed = _histogram(m, "vllm:request_prefill_kv_computed_tokens")
    assert kv_computed.sum == 17 - 4
    iteration = _histogram(m, "vllm:iteration_tokens_total")  # the empty step is no step
    assert (iteration.count, iteration.sum) == (3, 17 - 4 + 6)  # vLLM's: the prompt tokens computed
    # The ITL samples: a at +0.1, +0.1 (two later outputs); b at +0.1 (one later output).
    itl = _histogram(m, "vllm:inter_token_latency_seconds")
    assert itl.count == 3 and itl.sum == pytest.approx(0.3)


def test_latency_histograms_place_known_intervals(engine: _Engine) -> None:
    engine.add("r", 7)
    engine.step([_out("r", [1], events=[(QUEUED, 10.0), (SCHEDULED, 10.5)])], 11.0, ARRIVAL + 0.3)
    engine.step([_out("r", [2])], 11.04, ARRIVAL + 0.4)
    engine.step([_out("r", [3, 4])], 11.2, ARRIVAL + 0.5)
    engine.step([_out("r", [5], finish=FinishReason.LENGTH)], 12.0, ARRIVAL + 3.0, max_tokens=5)
    m = engine.metrics.get_metrics()
    ttft = _histogram(m, "vllm:time_to_first_token_seconds")
    assert ttft.count == 1 and ttft.sum == pytest.approx(0.3)
    assert ttft.buckets["0.25"] == 0 and ttft.buckets["0.5"] == 1
    itl = _histogram(m, "vllm:inter_token_latency_seconds")  # 0.04, 0.16, 0.8
    assert itl.count == 3 and itl.sum == pytest.approx(1.0)
    assert [itl.buckets[b] for b in ("0.025", "0.05", "0.15", "0.2", "0.75", "1.0")] == [0, 1, 1, 2, 2, 3]
    expected = {"vllm:e2e_request_latency_seconds": (3.0, "2.5", "5.0"),
                "vllm:request_queue_time_seconds": (0.5, "0.3", "0.5"),
                "vllm:request_prefill_time_seconds": (0.5, "0.3", "0.5"),
                "vllm:request_decode_time_seconds": (1.0, "0.8", "1.0"),
                "vllm:request_inference_time_seconds": (1.5, "1.0", "1.5")}
    for name, (value, below, at) in expected.items():
        h = _histogram(m, name)
        assert h.count == 1 and h.sum == pytest.approx(value), name
        assert h.buckets[below] == 0 and h.buckets[at] == 1, name
    tpot = _histogram(m, "vllm:request_time_per_output_token_seconds")  # 1.0 s over 4 decode tokens
    assert tpot.sum == pytest.approx(0.25) and tpot.buckets["0.2"] == 0 and tpot.buckets["0.3"] == 1
    max_tokens = _histogram(m, "vllm:request_params_max_tokens")
    assert (max_tokens.count, max_tokens.sum, max_tokens.buckets["5.0"]) == (1, 5, 1)


def test_request_state_stats_follow_vllm(engine: _Engine) -> None:
    """RequestOutput.metrics: the core's stamps, the first scheduling only, token count."""
    engine.add("r", 3)
    stats = engine.stats["r"]
    engine.step([_out("r", [1], events=[(QUEUED, 5.0), (SCHEDULED, 6.0)])], 7.0, ARRIVAL + 2.0)
    it = engine.step([_out("r", [2, 3], events=[(PREEMPTED, 7.5), (SCHEDULED, 8.0)])], 9.0, ARRIVAL + 4.0)
    assert (stats.queued_ts, stats.scheduled_ts) == (5.0, 6.0)
    assert (stats.first_token_ts, stats.last_token_ts) == (7.0, 9.0)
    assert stats.first_token_latency == pytest.approx(2.0)
    assert stats.num_generation_tokens == 3
    assert it.num_preempted_reqs == 1
    assert it.inter_token_latencies_iter == [2.0]  # one sample per output, as vLLM's


def test_request_resumed_after_restart_counts_prompt_once(engine: _Engine) -> None:
    """A core restart resubmits a request as prompt + tokens so far; its stats go on."""
    engine.add("r", 8)
    engine.step([_out("r", [1])], 100.0, ARRIVAL + 0.1)
    # The new core's clock may start anywhere: the interval across the restart is not negative.
    engine.step([_out("r", [2], events=[(QUEUED, 1.0), (SCHEDULED, 2.0)])], 3.0, ARRIVAL + 0.5)
    m = engine.metrics.get_metrics()
    assert _value(m, "vllm:prompt_tokens") == 8
    assert _value(m, "vllm:generation_tokens") == 2
    assert _histogram(m, "vllm:time_to_first_token_seconds").count == 1
    assert _histogram(m, "vllm:inter_token_latency_seconds").sum == 0.0


def test_request_finished_without_tokens(engine: _Engine) -> None:
    """Aborted while waiting: counted as an abort, no TTFT, no phase it never reached."""
    engine.add("r", 5)
    it = IterationStats(iteration_timestamp=ARRIVAL + 1.0)
    stats = engine.stats["r"]
    it.update_from_output(_out("r", [], events=[(QUEUED, 3.0)]), 4.0, 5, stats)
    it.update_from_finished_request("abort", 5, None, stats)
    engine.metrics.record(None, it)  # outside a step: no scheduler stats
    m = engine.metrics.get_metrics()
    assert _value(m, "vllm:request_success", finished_reason="abort") == 1
    assert _value(m, "vllm:prompt_tokens") == 0
    assert _histogram(m, "vllm:time_to_first_token_seconds").count == 0
    assert _histogram(m, "vllm:iteration_tokens_total").count == 0
    assert _histogram(m, "vllm:e2e_request_latency_seconds").sum == pytest.approx(1.0)
    for name in ("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds"):
        assert _histogram(m, name).sum == 0.0
    assert _histogram(m, "vllm:request_generation_tokens").buckets["1.0"] == 1  # a 0 observed
    assert _histogram(m, "vllm:request_params_max_tokens").count == 0  # none given


def test_gauges_and_core_counters_from_cumulative_stats(engine: _Engine) -> None:
    steps = [SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, kv_cache_usage=0.5,
                            prefix_cache_queries=100, prefix_cache_hits=40, num_generation_tokens=3),
             SchedulerStats(num_running_reqs=1, num_waiting_reqs=0, kv_cache_usage=0.25,
                            prefix_cache_queries=160, prefix_cache_hits=70, num_preemptions=2,
                            num_generation_tokens=9)]
    for i, sched in enumerate(steps):
        engine.step([], 10.0 + i, ARRIVAL + i, sched=sched)
    m = engine.metrics.get_metrics()
    assert _value(m, "vllm:num_requests_running") == 1
    assert _value(m, "vllm:num_requests_waiting") == 0
    assert _value(m, "vllm:kv_cache_usage_perc") == 0.25
    assert _value(m, "vllm:prefix_cache_queries") == 160  # the core's totals, not their sum
    assert _value(m, "vllm:prefix_cache_hits") == 70
    assert _value(m, "vllm:num_preemptions") == 2
    # A restarted core counts from zero: its values are all new.
    engine.step([], 20.0, ARRIVAL + 5, sched=SchedulerStats(prefix_cache_queries=20, prefix_cache_hits=5,
                                                            num_generation_tokens=1))
    m = engine.metrics.get_metrics()
    assert _value(m, "vllm:prefix_cache_queries") == 180
    assert _value(m, "vllm:prefix_cache_hits") == 75
    assert _value(m, "vllm:num_preemptions") == 2


def test_get_metrics_names_labels_and_exposition_prefix(engine: _Engine) -> None:
    m = engine.metrics.get_metrics()
    names = {metric.name for metric in m}
    assert all(name.startswith("vllm:") for name in names)
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
            "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
            "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:request_success",
            "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
            "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
            "vllm:request_prompt_tokens", "vllm:request_generation_tokens"} <= names
    running = _one(m, "vllm:num_requests_running")
    assert running.labels == {"model_name": "tiny", "engine": "0"}
    assert {r.labels["finished_reason"] for r in _find(m, "vllm:request_success")} == {
        "stop", "length", "abort", "error", "repetition"}  # vLLM's FINISH_REASON_STRINGS
    ttft = _histogram(m, "vllm:time_to_first_token_seconds")
    assert list(ttft.buckets)[:2] == ["0.001", "0.005"] and list(ttft.buckets)[-1] == "+Inf"
    assert len(_histogram(m, "vllm:request_prompt_tokens").buckets) == len(build_1_2_5_buckets(MAX_MODEL_LEN)) + 1
    text = prometheus_client.generate_latest(engine.metrics.registry).decode()
    assert 'vllm:prompt_tokens_total{engine="0",model_name="tiny"} 0.0' in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 0.0' in text
    assert "vllm:time_to_first_token_seconds_bucket" in text
    # Only what vLLM has no metric for is tidal's, and it is not among vLLM's records.
    assert {line.split("{")[0] for line in text.splitlines() if line.startswith("tidal:")} == {
        "tidal:num_core_restarts_total", "tidal:num_core_restarts_created"}
    assert "vllm:num_core_restarts" not in names


def test_prefix_is_configurable() -> None:
    metrics = EngineMetrics("m", 10, prefix="old:", engine_index=2)
    text = prometheus_client.generate_latest(metrics.registry).decode()
    assert 'old:generation_tokens_total{engine="2",model_name="m"}' in text
    assert 'tidal:num_core_restarts_total{engine="2",model_name="m"}' in text
    assert _one(metrics.get_metrics(), "vllm:generation_tokens").labels["engine"] == "2"


def _global_names() -> set[str]:
    return {m.name for m in prometheus_client.REGISTRY.collect()}


def test_two_engines_are_isolated() -> None:
    before = _global_names()
    # The same names twice in one process: in a shared registry the second would raise.
    first, second = _Engine(EngineMetrics("same", 50)), _Engine(EngineMetrics("same", 50))
    first.add("r", 4)
    first.step([_out("r", [1, 2])], 1.0, ARRIVAL + 1, sched=SchedulerStats(num_running_reqs=1))
    assert _value(first.metrics.get_metrics(), "vllm:generation_tokens") == 2
    assert _value(first.metrics.get_metrics(), "vllm:num_requests_running") == 1
    assert _value(second.metrics.get_metrics(), "vllm:generation_tokens") == 0
    assert _value(second.metrics.get_metrics(), "vllm:num_requests_running") == 0
    assert _global_names() == before  # nothing in prometheus_client's process-global registry


def test_log_line_throughput_over_interval(caplog: pytest.LogCaptureFixture) -> None:
    stat_logger = LoggingStatLogger(now=0.0)
    it = IterationStats(iteration_timestamp=ARRIVAL)
    it.num_prompt_tokens, it.num_cached_prompt_tokens, it.num_generation_tokens = 120, 20, 50
    stat_logger.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.25,
                                      prefix_cache_queries=200, prefix_cache_hits=50), it)
    with caplog.at_level(logging.DEBUG, logger="tidal.frontend.metrics"):
        stat_logger.log(now=10.0)
        assert stat_logger.last_line == (
            "Engine 000: Avg prompt throughput: 10.0 tokens/s, Avg generation throughput: 5.0 tokens/s, "
            "Running: 3 reqs, Waiting: 1 reqs, GPU KV cache usage: 25.0%, Prefix cache hit rate: 25.0%")
        stat_logger.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.1, prefix_cache_queries=300,
                                          prefix_cache_hits=150, num_preemptions=2), None)
        stat_logger.log(now=20.0)  # nothing served: 0 tok/s, the interval's hit rate (100/100)
        assert stat_logger.last_line == (
            "Engine 000: Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 0.0 tokens/s, "
            "Running: 1 reqs, Waiting: 0 reqs, Preemptions: 2, GPU KV cache usage: 10.0%, "
            "Prefix cache hit rate: 100.0%")
        stat_logger.log(now=30.0)  # idle twice running: DEBUG, and no lookups keep the last rate
        assert stat_logger.last_line.endswith("Prefix cache hit rate: 100.0%")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO, logging.DEBUG]


def test_spec_decoding_line_over_interval() -> None:
    """vLLM's SpecDecoding line: the interval's drafts (the core's cumulative counters turned
    into increments), mean acceptance length 1 + accepted / drafts, per-position rates."""
    stat_logger = LoggingStatLogger(now=0.0)
    stat_logger.record(SchedulerStats(spec_decode_num_drafts=10, spec_decode_num_draft_tokens=40,
                                      spec_decode_num_accepted_tokens=30,
                                      spec_decode_num_accepted_tokens_per_pos=[10, 9, 7, 4]), None)
    stat_logger.log(now=10.0)
    assert stat_logger.last_spec_line == (
        "Engine 000: SpecDecoding metrics: Mean acceptance length: 4.00, Accepted throughput: 3.00 tokens/s, "
        "Drafted throughput: 4.00 tokens/s, Accepted: 30 tokens, Drafted: 40 tokens, Per-position acceptance "
        "rate: 1.000, 0.900, 0.700, 0.400, Avg Draft acceptance rate: 75.0%")
    stat_logger.record(SchedulerStats(spec_decode_num_drafts=14, spec_decode_num_draft_tokens=48,
                                      spec_decode_num_accepted_tokens=31,
                                      spec_decode_num_accepted_tokens_per_pos=[11, 9, 7, 4]), None)
    stat_logger.log(now=20.0)  # 4 drafts of 8 tokens, 1 accepted
    assert "Mean acceptance length: 1.25" in stat_logger.last_spec_line
    assert "Per-position acceptance rate: 0.250, 0.000, 0.000, 0.000, Avg Draft acceptance rate: 12.5%" in (
        stat_logger.last_spec_line)
    stat_logger.log(now=30.0)
    assert stat_logger.last_spec_line == ""  # nothing drafted: no line


def test_maybe_log_and_extra_loggers() -> None:
    class Recorder(StatLoggerBase):
        def __init__(self, vllm_config: object = None, engine_index: int = 0) -> None:
            self.records: list[tuple[SchedulerStats | None, IterationStats | None]] = []
            self.logs = self.initialized = 0

        def log_engine_initialized(self) -> None:
            self.initialized += 1

        def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
                   mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
            self.records.append((scheduler_stats, iteration_stats))

        def log(self) -> None:
            self.logs += 1

    recorder = Recorder()
    t0 = time.monotonic()
    metrics = EngineMetrics("m", 10, log_interval_s=10.0, stat_loggers=[recorder])
    sched, it = SchedulerStats(), IterationStats()
    metrics.record(sched, it)
    assert len(recorder.records) == 1 and recorder.initialized == 1
    assert recorder.records[0][0] == sched and vars(recorder.records[0][1]) == vars(it)
    assert not metrics.maybe_log(now=t0 + 9.9)
    assert metrics.maybe_log(now=time.monotonic() + 10.0)
    assert recorder.logs == 1 and metrics.logging.last_line.startswith("Engine 000: Avg prompt")
    assert not metrics.maybe_log()  # the interval restarts at each log


def test_user_logger_that_mutates_stats_or_raises_cancelled_cannot_break_the_builtins() -> None:
    """A user's logger gets its own copies: editing them (now, or later through a reference it
    kept) changes nothing the built-in loggers show; CancelledError from its calls is its own
    failure, not a cancellation of the front-end (it used to escape `record`)."""
    import asyncio

    class Vandal(StatLoggerBase):
        def __init__(self, vllm_config: object = None, engine_index: int = 0) -> None:
            self.kept: list[SchedulerStats] = []

        def log_engine_initialized(self) -> None:
            raise asyncio.CancelledError

        def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
                   mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                scheduler_stats.num_running_reqs = "many"  # type: ignore[assignment]
                scheduler_stats.kv_cache_usage = None  # type: ignore[assignment]
                scheduler_stats.prefix_cache_queries = -1
                self.kept.append(scheduler_stats)
            if iteration_stats is not None:
                iteration_stats.num_generation_tokens = 10**9
                iteration_stats.finished_requests.clear()

        def log(self) -> None:
            for stats in self.kept:
                stats.num_waiting_reqs = "all"  # type: ignore[assignment]
            raise asyncio.CancelledError

    class Canceller(StatLoggerBase):
        def __init__(self, vllm_config: object = None, engine_index: int = 0) -> None:
            pass

        def log_engine_initialized(self) -> None:
            raise RuntimeError("bug in a user's log_engine_initialized()")

        def record(self, *args: object, **kwargs: object) -> None:
            raise asyncio.CancelledError

        def log(self) -> None:
            raise asyncio.CancelledError

    metrics = EngineMetrics("m", 10, log_interval_s=10.0, stat_loggers=[Vandal(), Canceller()])
    plain = EngineMetrics("m", 10, log_interval_s=10.0)  # the reference: no user loggers
    for engine_metrics in (metrics, plain):
        it = IterationStats(iteration_timestamp=ARRIVAL)
        it.num_generation_tokens = 7
        engine_metrics.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=1, kv_cache_usage=0.5,
                                             prefix_cache_queries=40, prefix_cache_hits=10), it)
        engine_metrics.log()
        engine_metrics.record(SchedulerStats(num_running_reqs=2, kv_cache_usage=0.25, prefix_cache_queries=80,
                                             prefix_cache_hits=30), None)
        engine_metrics.log()
    assert metrics.logging.last_line == plain.logging.last_line
    assert "Running: 2 reqs, Waiting: 0 reqs, GPU KV cache usage: 25.0%" in metrics.logging.last_line
    for name in ("vllm:generation_tokens", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
        assert _value(metrics.get_metrics(), name) == _value(plain.get_metrics(), name), name


async def test_server_logs_one_stats_line_per_interval(caplog: pytest.LogCaptureFixture) -> None:
    """tidal serve's stats line comes from two places: the output handler after a core message
    (maybe_log) and the server's timer task (for an idle engine). Whichever comes first logs;
    the lines are never closer than the interval (the timer used to force a second line
    milliseconds after the handler's, over an empty interval)."""
    import asyncio
    from types import SimpleNamespace

    from tidal.frontend.entrypoints.openai.api_server import _log_stats

    interval = 0.2
    metrics = EngineMetrics("m", 10, log_interval_s=interval)
    with caplog.at_level(logging.DEBUG, logger="tidal.frontend.metrics"):
        timer = asyncio.ensure_future(_log_stats(SimpleNamespace(metrics=metrics)))
        try:
            t_end = time.monotonic() + 6 * interval
            while time.monotonic() < t_end:  # busy: a core message every ~7 ms
                metrics.maybe_log()
                await asyncio.sleep(0.007)
            busy = len(caplog.records)
            await asyncio.sleep(3 * interval + 0.1)  # idle: no core message, the timer alone logs
        finally:
            timer.cancel()
            await asyncio.gather(timer, return_exceptions=True)
    times = [r.created for r in caplog.records if r.getMessage().startswith("Engine 000:")]
    assert len(times) == len(caplog.records)
    gaps = [b - a for a, b in zip(times, times[1:])]
    assert 3 <= busy <= 6 and len(times) - busy >= 2, (busy, len(times))
    assert min(gaps) >= interval / 2, gaps  # the double line came milliseconds after the first


def test_observe_many_exposes_what_observe_does() -> None:
    """The bulk observe of the per-token histograms against prometheus_client's own observe, one
    value at a time: the same exposition (buckets, count, sum), bounds hit exactly, values past
    the last bound, negatives, +-inf and NaN included; and a second batch adds to the first."""
    import random

    from tidal.frontend.metrics import ITL_BUCKETS, observe_many

    rng = random.Random(7)
    values = [rng.uniform(0, 0.2) for _ in range(300)] + ITL_BUCKETS + [0.0, -1.0, 1e9, float("inf"),
                                                                      float("-inf"), float("nan")]
    rng.shuffle(values)
    exposed = []
    for bulk in (False, True):
        registry = prometheus_client.CollectorRegistry()
        h = prometheus_client.Histogram("t_itl", "d", ["engine"], buckets=ITL_BUCKETS, registry=registry).labels("0")
        for part in (values[:100], values[100:], []):
            if bulk:
                observe_many(h, part)
            else:
                for v in part:
                    h.observe(v)
        text = prometheus_client.generate_latest(registry).decode()
        exposed.append(sorted(line for line in text.splitlines() if "_created" not in line))
    assert exposed[0] == exposed[1]
    # 325 values; NaN fits no bucket, so the count (the +Inf bucket) leaves it out, as observe does
    assert any(line.startswith('t_itl_count{engine="0"} 324.0') for line in exposed[1])
