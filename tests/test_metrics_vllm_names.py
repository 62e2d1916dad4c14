"""vLLM's metric names and stat-logger API, checked against vLLM's own source as the spec:

- /metrics of a real `tidal serve` (tiny model) serves the names of EXPECTED_METRICS_V1 in vLLM's
  tests/entrypoints/openai/test_metrics.py (transcribed below), with the counts its
  `_get_expected_values` expects after N requests of P prompt tokens and M max_tokens;
- every `vllm:` family there is one of vLLM's PrometheusStatLogger (vllm/v1/metrics/loggers.py,
  transcribed below: names, types, label sets, bucket bounds), labelled `model_name`/`engine`
  as vLLM's; what vLLM has no metric for is `tidal:`;
- `vllm:num_requests_waiting_by_reason` splits the waiting requests by vLLM's reasons;
- `vllm:cache_config_info` is vLLM's info gauge, the cache config as labels;
- a stat logger written for vLLM (tests/v1/engine/test_async_llm.py's customised loggers: a
  StatLoggerBase subclass built with `(vllm_config, engine_index)`, LoggingStatLogger and
  AggregatedLoggingStatLogger subclasses) runs unchanged as `stat_loggers=[...]`, and
  StatLoggerManager builds vLLM's logger list.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Iterator
from typing import Any
from unittest.mock import MagicMock

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import Server, http_get, parse_metrics, wait_for

MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 512
BLOCK_SIZE = 16
SERVER_FLAGS = ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_KV_BLOCKS),
                "--block-size", str(BLOCK_SIZE), "--served-model-name", "tiny"]

# ---------------------------------------------------------------------------------------------
# Transcribed from vLLM's tests/entrypoints/openai/test_metrics.py.
EXPECTED_METRICS_V1 = [
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
    "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total",
    "vllm:generation_tokens_total",
    "vllm:iteration_tokens_total",
    "vllm:cache_config_info",
    "vllm:request_success_total",
    "vllm:request_prompt_tokens_sum",
    "vllm:request_prompt_tokens_bucket",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_sum",
    "vllm:request_generation_tokens_bucket",
    "vllm:request_generation_tokens_count",
    "vllm:request_params_n_sum",
    "vllm:request_params_n_bucket",
    "vllm:request_params_n_count",
    "vllm:request_params_max_tokens_sum",
    "vllm:request_params_max_tokens_bucket",
    "vllm:request_params_max_tokens_count",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count",
    "vllm:time_to_first_token_seconds_sum",
    "vllm:time_to_first_token_seconds_bucket",
    "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_sum",
    "vllm:inter_token_latency_seconds_bucket",
    "vllm:inter_token_latency_seconds_count",
    "vllm:e2e_request_latency_seconds_sum",
    "vllm:e2e_request_latency_seconds_bucket",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_sum",
    "vllm:request_queue_time_seconds_bucket",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_inference_time_seconds_sum",
    "vllm:request_inference_time_seconds_bucket",
    "vllm:request_inference_time_seconds_count",
    "vllm:request_prefill_time_seconds_sum",
    "vllm:request_prefill_time_seconds_bucket",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_sum",
    "vllm:request_decode_time_seconds_bucket",
    "vllm:request_decode_time_seconds_count",
]
# Shown only with --show-hidden-metrics-for-version (vLLM's test skips them without it).
HIDDEN_DEPRECATED_METRICS = [
    "vllm:gpu_cache_usage_perc",
    "vllm:gpu_prefix_cache_queries",
    "vllm:gpu_prefix_cache_hits",
    "vllm:time_per_output_token_seconds_sum",
    "vllm:time_per_output_token_seconds_bucket",
    "vllm:time_per_output_token_seconds_count",
]
# The label names of vLLM's cache_config_info in the same test (CacheConfig.metrics_info()).
CACHE_CONFIG_INFO_LABELS = {"block_size", "cache_dtype", "cpu_offload_gb", "enable_prefix_caching",
                            "gpu_memory_utilization", "num_cpu_blocks", "num_gpu_blocks", "num_gpu_blocks_override",
                            "sliding_window", "swap_space_bytes"}

# ---------------------------------------------------------------------------------------------
# Transcribed from vLLM's vllm/v1/metrics/loggers.py (PrometheusStatLogger), the metrics it
# registers without optional features (no LoRA, KV connector, speculation, KV-cache residency
# sampling, NaN checks, hidden metrics): family -> (type, label beyond model_name/engine and
# its values, or None).
LABEL_VALUES = {
    "reason": {"capacity", "deferred"},  # WAITING_REASON_CAPACITY, WAITING_REASON_DEFERRED
    "sleep_state": {"awake", "weights_offloaded", "discard_all"},
    "source": {"local_compute", "local_cache_hit", "external_kv_transfer"},  # PromptTokenStats.ALL_SOURCES
    "finished_reason": {"stop", "length", "abort", "error", "repetition"},  # FINISH_REASON_STRINGS
}
VLLM_FAMILIES: dict[str, tuple[str, str | None]] = {
    "vllm:num_requests_running": ("gauge", None),
    "vllm:num_requests_waiting": ("gauge", None),
    "vllm:num_requests_waiting_by_reason": ("gauge", "reason"),
    "vllm:engine_sleep_state": ("gauge", "sleep_state"),
    "vllm:kv_cache_usage_perc": ("gauge", None),
    "vllm:prefix_cache_queries": ("counter", None),
    "vllm:prefix_cache_hits": ("counter", None),
    "vllm:external_prefix_cache_queries": ("counter", None),
    "vllm:external_prefix_cache_hits": ("counter", None),
    "vllm:mm_cache_queries": ("counter", None),
    "vllm:mm_cache_hits": ("counter", None),
    "vllm:num_preemptions": ("counter", None),
    "vllm:prompt_tokens": ("counter", None),
    "vllm:prompt_tokens_by_source": ("counter", "source"),
    "vllm:prompt_tokens_cached": ("counter", None),
    "vllm:generation_tokens": ("counter", None),
    "vllm:request_success": ("counter", "finished_reason"),
    "vllm:request_prompt_tokens": ("histogram", None),
    "vllm:request_generation_tokens": ("histogram", None),
    "vllm:iteration_tokens_total": ("histogram", None),
    "vllm:request_max_num_generation_tokens": ("histogram", None),
    "vllm:request_params_n": ("histogram", None),
    "vllm:request_params_max_tokens": ("histogram", None),
    "vllm:time_to_first_token_seconds": ("histogram", None),
    "vllm:inter_token_latency_seconds": ("histogram", None),
    "vllm:request_time_per_output_token_seconds": ("histogram", None),
    "vllm:e2e_request_latency_seconds": ("histogram", None),
    "vllm:request_queue_time_seconds": ("histogram", None),
    "vllm:request_inference_time_seconds": ("histogram", None),
    "vllm:request_prefill_time_seconds": ("histogram", None),
    "vllm:request_decode_time_seconds": ("histogram", None),
    "vllm:request_prefill_kv_computed_tokens": ("histogram", None),
}
VLLM_INFO_FAMILIES = {"vllm:cache_config_info"}  # a gauge whose labels are a config's fields
_ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
_LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
            480.0, 960.0, 1920.0, 7680.0]
_1_2_5_TO_512 = [1, 2, 5, 10, 20, 50, 100, 200, 500]  # build_1_2_5_buckets(max_model_len=512)
VLLM_BUCKETS = {
    "vllm:request_prompt_tokens": _1_2_5_TO_512,
    "vllm:request_generation_tokens": _1_2_5_TO_512,
    "vllm:request_max_num_generation_tokens": _1_2_5_TO_512,
    "vllm:request_params_max_tokens": _1_2_5_TO_512,
    "vllm:request_prefill_kv_computed_tokens": _1_2_5_TO_512,
    "vllm:iteration_tokens_total": [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384],
    "vllm:request_params_n": [1, 2, 5, 10, 20],
    "vllm:time_to_first_token_seconds": [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                                         2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0],
    "vllm:inter_token_latency_seconds": _ITL,
    "vllm:request_time_per_output_token_seconds": _ITL,
    "vllm:e2e_request_latency_seconds": _LATENCY,
    "vllm:request_queue_time_seconds": _LATENCY,
    "vllm:request_inference_time_seconds": _LATENCY,
    "vllm:request_prefill_time_seconds": _LATENCY,
    "vllm:request_decode_time_seconds": _LATENCY,
}


def _expected_values(n: int, p: int, m: int) -> dict[str, float]:
    """vLLM's `_get_expected_values(num_requests, prompt_ids, max_tokens)` as (sample -> value),
    with its deprecated time_per_output_token_seconds under the name vLLM renamed it to in
    0.11 (inter_token_latency_seconds); plus, from vLLM's loggers.py, what the other per-request
    metrics count for the same requests (no prefix-cache hits: request_prefill_kv_computed_tokens
    is the whole prompt, every prompt token is local_compute)."""
    return {
        "vllm:time_to_first_token_seconds_count": n,
        "vllm:inter_token_latency_seconds_count": n * (m - 1),
        "vllm:e2e_request_latency_seconds_count": n,
        "vllm:request_queue_time_seconds_count": n,
        "vllm:request_inference_time_seconds_count": n,
        "vllm:request_prefill_time_seconds_count": n,
        "vllm:request_decode_time_seconds_count": n,
        "vllm:request_prompt_tokens_sum": n * p,
        "vllm:request_prompt_tokens_count": n,
        "vllm:request_generation_tokens_sum": n * m,
        "vllm:request_generation_tokens_count": n,
        "vllm:request_params_n_count": n,
        "vllm:request_params_max_tokens_sum": n * m,
        "vllm:request_params_max_tokens_count": n,
        "vllm:iteration_tokens_total_sum": n * (p + m),
        "vllm:iteration_tokens_total_count": n * m,
        "vllm:prompt_tokens_total": n * p,
        "vllm:generation_tokens_total": n * m,
        "vllm:request_success_total": n,
        # beyond vLLM's test, by loggers.py's definitions:
        "vllm:request_params_n_sum": n,  # n=1 each
        'vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"}': n,
        "vllm:request_max_num_generation_tokens_sum": n * m,
        "vllm:request_max_num_generation_tokens_count": n,
        "vllm:request_time_per_output_token_seconds_count": n,
        "vllm:request_prefill_kv_computed_tokens_sum": n * p,
        "vllm:request_prefill_kv_computed_tokens_count": n,
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_compute"}': n * p,
        'vllm:prompt_tokens_by_source_total{engine="0",model_name="tiny",source="local_cache_hit"}': 0,
        "vllm:prompt_tokens_cached_total": 0,
    }


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str) -> Iterator[Server]:
    srv = Server(tiny_model_dir, SERVER_FLAGS, tidal_cache_dir)
    yield srv
    srv.stop()


def _scrape(server: Server) -> str:
    status, body = http_get(server.url + "/metrics")
    assert status == 200, body
    return body.decode()


def _families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_expected_metrics_are_served(server: Server) -> None:
    """vLLM's test_metrics_exist: after a request, every name of EXPECTED_METRICS_V1 (but the
    hidden deprecated ones) is on /metrics; and none under tidal's old `tidal:` names."""
    server.client().completions.create(model="tiny", prompt="Hello, my name is", max_tokens=5, temperature=0.0)
    text = _scrape(server)
    samples = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    families = set(_families(text))
    for metric in EXPECTED_METRICS_V1:
        if metric in HIDDEN_DEPRECATED_METRICS:
            continue
        assert metric in samples or metric in families, metric
        assert "tidal:" + metric.removeprefix("vllm:") not in text, metric


def test_counts_are_vllms_expected_values(server: Server) -> None:
    """vLLM's test_metrics_counts: N sequential completions of P prompt token ids and M
    max_tokens move each count by what vLLM's `_get_expected_values` says (ignore_eos, so each
    generates M tokens; prompts differing in their first token, so no prefix-cache hit)."""
    n, p, m = 10, 10, 10
    client = server.client()
    before = parse_metrics(_scrape(server))
    for i in range(n):
        prompt_ids = [1 + i] + [100 + j for j in range(p - 1)]
        res = client.completions.create(model="tiny", prompt=prompt_ids, max_tokens=m,
                                        extra_body={"ignore_eos": True})
        assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (p, m)
    after = parse_metrics(_scrape(server))
    assert after["vllm:prefix_cache_hits_total"] == before["vllm:prefix_cache_hits_total"]  # the premise
    deltas = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in _expected_values(n, p, m)}
    assert deltas == _expected_values(n, p, m)
    wait_for(lambda: _idle(server), 30, "the gauges to show an idle engine")  # the core's next stats


def test_an_n_request_is_one_sample_of_n_through_the_server(server: Server) -> None:
    """The output processor wires n > 1 requests as vLLM does: one request_params_n sample of n
    and one request_max_num_generation_tokens sample per user request, when its last child ends."""
    names = ("vllm:request_params_n_count", "vllm:request_params_n_sum",
             "vllm:request_max_num_generation_tokens_count", "vllm:request_max_num_generation_tokens_sum",
             "vllm:request_params_max_tokens_count")
    before = parse_metrics(_scrape(server))
    res = server.client().completions.create(model="tiny", prompt=[7, 8, 9], n=3, max_tokens=6,
                                             extra_body={"ignore_eos": True})
    assert len(res.choices) == 3 and res.usage.completion_tokens == 18
    after = parse_metrics(_scrape(server))
    assert [after[k] - before[k] for k in names] == [1, 3, 1, 6, 3]


def _idle(server: Server) -> bool:
    m = parse_metrics(_scrape(server))
    return m["vllm:num_requests_running"] == m["vllm:num_requests_waiting"] == 0 and \
        m["vllm:num_requests_waiting_by_reason"] == 0


def test_every_vllm_family_is_vllms_with_its_labels_and_buckets(server: Server) -> None:
    """Each `vllm:` family on /metrics is one of vLLM's PrometheusStatLogger (its type, its
    labels: model_name = the served name, engine = "0", plus its own label with vLLM's values,
    `le` on buckets with vLLM's bounds); every one of vLLM's is there; tidal's own are `tidal:`."""
    server.client().completions.create(model="tiny", prompt="abc", max_tokens=3)
    families = {name: f for name, f in _families(_scrape(server)).items() if not name.endswith("_created")}
    served = {name for name in families if name.startswith("vllm:")}
    assert served - VLLM_INFO_FAMILIES == set(VLLM_FAMILIES)
    assert {name for name in families if name.startswith("tidal:")} == {"tidal:num_core_restarts"}
    for name, (kind, label) in VLLM_FAMILIES.items():
        family = families[name]
        assert family.type == kind, name
        extra = {label} if label else set()
        seen_values = set()
        for sample in family.samples:
            keys = set(sample.labels) - ({"le"} if sample.name.endswith("_bucket") else set())
            assert keys == {"model_name", "engine"} | extra, (name, sample)
            assert (sample.labels["model_name"], sample.labels["engine"]) == ("tiny", "0"), sample
            if label:
                seen_values.add(sample.labels[label])
        if label:
            assert seen_values == LABEL_VALUES[label], name
        if kind == "histogram":
            bounds = [float(s.labels["le"]) for s in family.samples if s.name == name + "_bucket"]
            assert bounds == [*map(float, VLLM_BUCKETS[name]), float("inf")], name
    assert {s.labels["sleep_state"]: s.value for s in families["vllm:engine_sleep_state"].samples} == {
        "awake": 1.0, "weights_offloaded": 0.0, "discard_all": 0.0}  # tidal's engine never sleeps


def test_cache_config_info_is_vllms_info_gauge(server: Server) -> None:
    """vllm:cache_config_info: one sample, value 1, labelled with the cache config (vLLM's
    label names) and engine; its values are the flags the server was started with."""
    families = _families(_scrape(server))
    assert "vllm:cache_config_info" in families, "no vllm:cache_config_info on /metrics"
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.value == 1.0
    assert CACHE_CONFIG_INFO_LABELS | {"engine"} <= set(sample.labels)
    assert sample.labels["engine"] == "0"
    assert sample.labels["block_size"] == str(BLOCK_SIZE)
    assert sample.labels["num_gpu_blocks"] == str(NUM_KV_BLOCKS)
    assert sample.labels["enable_prefix_caching"] == "True"  # the default, vLLM's too


@pytest.fixture(scope="module")
def one_seq_server(tiny_model_dir: str, tidal_cache_dir: str) -> Iterator[Server]:
    srv = Server(tiny_model_dir, [*SERVER_FLAGS, "--max-num-seqs", "1"], tidal_cache_dir)
    yield srv
    srv.stop()


def test_waiting_by_reason_counts_requests_waiting_for_capacity(one_seq_server: Server) -> None:
    """With --max-num-seqs 1 and three long requests at once, two wait for capacity: vLLM's
    `reason="capacity"` series says 2, `"deferred"` 0, and they sum to num_requests_waiting;
    all three are 0 again once the requests are done."""
    server = one_seq_server
    client = server.client()
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            client.completions.create(model="tiny", prompt=[1 + i, 2, 3], max_tokens=MAX_MODEL_LEN - 8,
                                      extra_body={"ignore_eos": True})
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    seen: list[dict[str, float]] = []

    def two_waiting() -> bool:
        seen.append(parse_metrics(_scrape(server)))
        return seen[-1]["vllm:num_requests_running"] == 1 and seen[-1]["vllm:num_requests_waiting"] == 2

    threads = [threading.Thread(target=one, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    try:
        wait_for(two_waiting, 60, "one running and two waiting requests")
        m = seen[-1]
        capacity = m['vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"}']
        deferred = m['vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"}']
        assert (capacity, deferred) == (2, 0)
        assert capacity + deferred == m["vllm:num_requests_waiting"]
    finally:
        for t in threads:
            t.join(120)
    assert not errors and not any(t.is_alive() for t in threads)
    # The gauges are the core's latest stats: those after the last step come with its next message.
    wait_for(lambda: _idle(server), 30, "no running and no waiting request")


# ---------------------------------------------------------------------------------------------
# Stat loggers, as vLLM's tests/v1/engine/test_async_llm.py customises them.

def _loggers() -> Any:
    import tidal.v1.metrics.loggers as loggers

    return loggers


def _counting_logger_class() -> type:
    loggers = _loggers()

    class CountingStatLogger(loggers.StatLoggerBase):
        """A logger written for vLLM: its constructor, record(), log_engine_initialized(), log()."""

        instances: list[Any] = []

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.vllm_config, self.engine_index = vllm_config, engine_index
            self.records: list[tuple[Any, Any, Any, int]] = []
            self.initialized = self.logs = 0
            CountingStatLogger.instances.append(self)

        def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
                   engine_idx: int = 0) -> None:
            self.records.append((scheduler_stats, iteration_stats, mm_cache_stats, engine_idx))

        def log_engine_initialized(self) -> None:
            self.initialized += 1

        def log(self) -> None:
            self.logs += 1

    return CountingStatLogger


def _mock_loggers() -> tuple[type, type]:
    """vLLM's MockLoggingStatLogger and MockAggregatedStatLogger, as its test writes them."""
    loggers = _loggers()

    class MockLoggingStatLogger(loggers.LoggingStatLogger):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            super().__init__(vllm_config, engine_index)
            self.log = MagicMock()

    class MockAggregatedStatLogger(loggers.AggregatedLoggingStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int]) -> None:
            super().__init__(vllm_config, engine_indexes)
            self.log = MagicMock()

    return MockLoggingStatLogger, MockAggregatedStatLogger


def _check_counting_logger(stat_logger: Any, prompt_lens: list[int], max_tokens: list[int]) -> None:
    from tidal.v1.metrics.stats import IterationStats, SchedulerStats

    assert stat_logger.engine_index == 0 and stat_logger.initialized == 1
    iterations = [it for _, it, _, _ in stat_logger.records if it is not None]
    assert all(isinstance(it, IterationStats) for it in iterations)
    assert sum(it.num_generation_tokens for it in iterations) == sum(max_tokens)
    assert sum(it.num_prompt_tokens for it in iterations) == sum(prompt_lens)
    finished = [f for it in iterations for f in it.finished_requests]
    assert sorted(f.num_generation_tokens for f in finished) == sorted(max_tokens)
    assert {f.finish_reason for f in finished} == {"length"}
    assert sorted(n for it in iterations for n in it.n_params_iter) == [1] * len(max_tokens)
    scheduler = [s for s, _, _, _ in stat_logger.records if s is not None]
    assert scheduler and all(isinstance(s, SchedulerStats) for s in scheduler)
    # The core's cumulative generation count, as the last step reports it, is what was generated.
    assert scheduler[-1].num_generation_tokens == sum(max_tokens)
    assert all(engine_idx == 0 and mm is None for _, _, mm, engine_idx in stat_logger.records)


async def test_vllm_stat_loggers_run_unchanged_in_async_llm(long_model_dir: str) -> None:
    """vLLM's test_customize_loggers / test_customize_aggregated_loggers with AsyncLLM: each
    `stat_loggers` class is built (a per-engine one with (vllm_config, 0), an aggregated one with
    engine_indexes [0]), told the engine is up once, given every step's scheduler and iteration
    stats (their token counts the tokens generated), and logged once by do_log_stats()."""
    from tidal.frontend import AsyncEngineArgs, AsyncLLM
    from tidal.protocol import SamplingParams
    from tidal.v1.engine.async_llm import AsyncLLM as VllmPathAsyncLLM

    assert VllmPathAsyncLLM is AsyncLLM
    counting = _counting_logger_class()
    mock_logging, mock_aggregated = _mock_loggers()
    args = AsyncEngineArgs(model=long_model_dir, model_runner="null", max_model_len=1024)
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[counting, mock_logging, mock_aggregated])
    try:
        prompt_lens, max_tokens = [5, 9, 3], [4, 7, 11]
        for i, (p, m) in enumerate(zip(prompt_lens, max_tokens)):
            params = SamplingParams(max_tokens=m, ignore_eos=True)
            outs = [o async for o in engine.generate({"prompt_token_ids": list(range(1, 1 + p))}, params, f"r{i}")]
            assert len(outs[-1].outputs[0].token_ids) == m
        await asyncio.wait_for(engine.do_log_stats(), 30)
        (stat_logger,) = counting.instances
        assert stat_logger.vllm_config.model_config.max_model_len == 1024
        _check_counting_logger(stat_logger, prompt_lens, max_tokens)
        assert stat_logger.logs == 1
        built = engine.metrics.user_loggers
        assert [type(s) for s in built] == [counting, mock_logging, mock_aggregated]
        built[1].log.assert_called_once()
        built[2].log.assert_called_once()
        assert built[2].engine_indexes == [0] and built[1].engine_index == 0
    finally:
        engine.shutdown()


def test_vllm_stat_logger_runs_unchanged_in_llm_engine(long_model_dir: str) -> None:
    """The same logger with the synchronous LLMEngine.from_engine_args(..., stat_loggers=[...])."""
    from tidal.frontend import EngineArgs, LLMEngine
    from tidal.protocol import SamplingParams

    counting = _counting_logger_class()
    args = EngineArgs(model=long_model_dir, model_runner="null", max_model_len=1024, disable_log_stats=False)
    engine = LLMEngine.from_engine_args(args, stat_loggers=[counting])
    try:
        prompt_lens, max_tokens = [6, 2], [5, 8]
        for i, (p, m) in enumerate(zip(prompt_lens, max_tokens)):
            engine.add_request(f"s{i}", {"prompt_token_ids": list(range(1, 1 + p))},
                               SamplingParams(max_tokens=m, ignore_eos=True))
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        assert not engine.has_unfinished_requests()
        (stat_logger,) = counting.instances
        _check_counting_logger(stat_logger, prompt_lens, max_tokens)
        logged = stat_logger.logs
        assert engine.logger_manager is engine.metrics is not None  # vLLM's attribute
        engine.do_log_stats()  # vLLM's: every logger logs now
        assert stat_logger.logs == logged + 1
    finally:
        engine.shutdown()


def test_stat_logger_manager_builds_vllms_logger_list(tiny_model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's StatLoggerManager: custom loggers first (a per-engine one behind a
    PerEngineStatLoggerAdapter, an aggregated one as is), then the default LoggingStatLogger
    (INFO on), then a PrometheusStatLogger; log() reaches each; its Prometheus logger exports
    cache_config_info from the config once log_engine_initialized() ran."""
    from prometheus_client import generate_latest

    from tidal.frontend import EngineArgs

    loggers = _loggers()
    mock_logging, mock_aggregated = _mock_loggers()
    config = EngineArgs(model=tiny_model_dir, max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_KV_BLOCKS,
                        block_size=BLOCK_SIZE).create_engine_config()
    caplog.set_level(logging.INFO, logger="tidal.frontend.metrics")
    manager = loggers.StatLoggerManager(config, custom_stat_loggers=[mock_logging])
    stat_loggers = manager.stat_loggers
    assert len(stat_loggers) == 3  # MockLoggingStatLogger + LoggingStatLogger + PrometheusStatLogger
    manager.log()
    stat_loggers[0].per_engine_stat_loggers[0].log.assert_called_once()
    assert isinstance(stat_loggers[1], loggers.PerEngineStatLoggerAdapter)
    assert isinstance(stat_loggers[1].per_engine_stat_loggers[0], loggers.LoggingStatLogger)
    assert isinstance(stat_loggers[2], loggers.PrometheusStatLogger)

    manager = loggers.StatLoggerManager(config, custom_stat_loggers=[mock_logging, mock_aggregated])
    stat_loggers = manager.stat_loggers
    assert len(stat_loggers) == 4
    manager.log()
    stat_loggers[0].per_engine_stat_loggers[0].log.assert_called_once()
    stat_loggers[1].log.assert_called_once()
    assert isinstance(stat_loggers[2], loggers.PerEngineStatLoggerAdapter)
    assert isinstance(stat_loggers[2].per_engine_stat_loggers[0], loggers.LoggingStatLogger)
    assert isinstance(stat_loggers[3], loggers.PrometheusStatLogger)

    prometheus = stat_loggers[3]
    assert "vllm:cache_config_info" not in generate_latest(prometheus.registry).decode()
    manager.log_engine_initialized()
    families = _families(generate_latest(prometheus.registry).decode())
    (sample,) = families["vllm:cache_config_info"].samples
    assert CACHE_CONFIG_INFO_LABELS | {"engine"} <= set(sample.labels) and sample.value == 1.0
    assert (sample.labels["block_size"], sample.labels["num_gpu_blocks"]) == (str(BLOCK_SIZE), str(NUM_KV_BLOCKS))
    assert set(families["vllm:num_requests_running"].samples[0].labels) == {"model_name", "engine"}


def test_n_and_max_num_generation_tokens_are_per_user_request() -> None:
    """vLLM's ParentRequest.observe_finished_request: an n=3 request's children add one
    request_params_n sample (3) and one request_max_num_generation_tokens sample (the most any
    child generated) when the last of them finishes; request_params_max_tokens is per child."""
    from tidal.frontend.metrics import EngineMetrics
    from tidal.protocol.outputs import RequestStateStats
    from tidal.v1.metrics.stats import IterationStats

    metrics = EngineMetrics("m", 100)
    generated = [4, 9, 6]
    it = IterationStats(iteration_timestamp=10.0)
    for i, n_tokens in enumerate(generated):
        stats = RequestStateStats(arrival_time=9.0, num_generation_tokens=n_tokens)
        it.update_from_finished_request("length", 5, 9, stats, n_param=3, group_finished=i == 2,
                                        group_max_generation_tokens=max(generated[:i], default=0))
    metrics.record(None, it)
    by_name = {m.name: m for m in metrics.get_metrics() if not m.labels.keys() - {"model_name", "engine"}}
    n_hist, max_gen, max_tokens = (by_name[f"vllm:{name}"] for name in (
        "request_params_n", "request_max_num_generation_tokens", "request_params_max_tokens"))
    assert (n_hist.count, n_hist.sum, n_hist.buckets["2.0"], n_hist.buckets["5.0"]) == (1, 3, 0, 1)
    assert (max_gen.count, max_gen.sum) == (1, 9)
    assert (max_tokens.count, max_tokens.sum) == (3, 27)


def test_spec_decode_counters_are_vllms() -> None:
    """vLLM's speculative-decoding counters from the core's cumulative SchedulerStats: drafts,
    draft tokens, accepted tokens, and accepted tokens per position (a Vector record in
    get_metrics(), as vLLM's reader makes it); a restarted core counts from zero again."""
    from tidal.frontend.metrics import EngineMetrics
    from tidal.v1.metrics.reader import Counter, Vector
    from tidal.v1.metrics.stats import IterationStats, SchedulerStats

    metrics = EngineMetrics("m", 100)
    assert not any(m.name.startswith("vllm:spec_decode") for m in metrics.get_metrics())  # speculation off
    steps = [SchedulerStats(spec_decode_num_drafts=2, spec_decode_num_draft_tokens=6,
                            spec_decode_num_accepted_tokens=3, spec_decode_num_accepted_tokens_per_pos=[2, 1, 0]),
             SchedulerStats(spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                            spec_decode_num_accepted_tokens=8, spec_decode_num_accepted_tokens_per_pos=[4, 3, 1]),
             # a new core: its counts are all new
             SchedulerStats(spec_decode_num_drafts=1, spec_decode_num_draft_tokens=3,
                            spec_decode_num_accepted_tokens=1, spec_decode_num_accepted_tokens_per_pos=[1, 0, 0])]
    for stats in steps:
        metrics.record(stats, IterationStats())
    records = {m.name: m for m in metrics.get_metrics() if m.name.startswith("vllm:spec_decode")}
    assert {name: (r.value if isinstance(r, Counter) else r.values) for name, r in records.items()} == {
        "vllm:spec_decode_num_drafts": 6, "vllm:spec_decode_num_draft_tokens": 18,
        "vllm:spec_decode_num_accepted_tokens": 9, "vllm:spec_decode_num_accepted_tokens_per_pos": [5, 3, 1]}
    assert isinstance(records["vllm:spec_decode_num_accepted_tokens_per_pos"], Vector)
    assert records["vllm:spec_decode_num_accepted_tokens_per_pos"].labels == {"model_name": "m", "engine": "0"}
