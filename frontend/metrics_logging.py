"""vLLM's log-line stat loggers (vllm/v1/metrics/loggers.py's LoggingStatLogger family): the
one-line summary every log interval, vLLM's SpecDecoding line, the summary over several engines,
and the adapter that runs one logger per engine. The Prometheus logger and the manager that
drives them all are in metrics.py, which re-exports these names."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, TypeAlias

from tidal.frontend.metrics_stats import AggregateStatLoggerBase, CoreCounterDeltas, IterationStats, StatLoggerBase
from tidal.protocol.messages import SchedulerStats

# The metrics module's logger: the stats line is what users filter for under that name.
logger = logging.getLogger("tidal.frontend.metrics")

PerEngineStatLoggerFactory: TypeAlias = Callable[[Any, int], StatLoggerBase]  # vLLM's: (vllm_config, engine_index)


def _num_gpu_blocks(vllm_config: Any) -> int | None:
    cache_config = getattr(vllm_config, "cache_config", None)
    return getattr(cache_config, "num_gpu_blocks", None)


class LoggingStatLogger(StatLoggerBase):
    """vLLM's one-line summary, logged by `log()`: throughput over the interval since the last
    log (prompt tokens the core computed, i.e. not from the prefix cache, and generation
    tokens), the latest running/waiting counts and KV usage, the prefix-cache hit rate over the
    interval (the previous rate when the interval had no lookups). At INFO while busy, DEBUG
    once idle, so an idle server's log stays quiet. `vllm_config` may be None (tidal's own use)."""

    def __init__(self, vllm_config: Any = None, engine_index: int = 0, *, now: float | None = None) -> None:
        self.vllm_config = vllm_config
        self.engine_index = engine_index
        self.aggregated = False  # AggregatedLoggingStatLogger: the stats of several engines
        self.last_scheduler_stats = SchedulerStats()
        self.last_prompt_throughput = 0.0
        self.last_generation_throughput = 0.0
        self.prefix_cache_hit_rate = 0.0
        self.engine_is_idle = True
        self.last_line = ""
        self.last_spec_line = ""  # the SpecDecoding line of the last interval ("" without drafts)
        self._deltas: dict[int, CoreCounterDeltas] = {}
        self._reset(time.monotonic() if now is None else now)

    @property
    def log_prefix(self) -> str:
        return f"Engine {self.engine_index:03d}: "

    def _reset(self, now: float) -> None:
        self.last_log_time = now
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.spec = SpecDecodingInterval()

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        if iteration_stats is not None:
            self.num_prompt_tokens += iteration_stats.num_computed_prompt_tokens
            self.num_generation_tokens += iteration_stats.num_generation_tokens
        if scheduler_stats is not None:
            deltas = self._deltas.setdefault(engine_idx, CoreCounterDeltas()).update(scheduler_stats)
            self.num_preemptions += deltas["num_preemptions"]
            self.prefix_cache_queries += deltas["prefix_cache_queries"]
            self.prefix_cache_hits += deltas["prefix_cache_hits"]
            self.spec.add(deltas, self._deltas[engine_idx].accepted_per_pos)
            if not self.aggregated:
                self.last_scheduler_stats = scheduler_stats

    def aggregate_scheduler_stats(self) -> None:
        """A per-engine logger has nothing to aggregate (AggregatedLoggingStatLogger has)."""

    def log(self, now: float | None = None) -> None:
        """Log the line (kept in `last_line`) and start a new interval."""
        now = time.monotonic() if now is None else now
        elapsed = now - self.last_log_time
        prompt_tp = self.num_prompt_tokens / elapsed if elapsed > 0 else 0.0
        generation_tp = self.num_generation_tokens / elapsed if elapsed > 0 else 0.0
        if self.prefix_cache_queries:
            self.prefix_cache_hit_rate = self.prefix_cache_hits / self.prefix_cache_queries
        self.engine_is_idle = not any((prompt_tp, generation_tp, self.last_prompt_throughput,
                                       self.last_generation_throughput))
        self.last_prompt_throughput, self.last_generation_throughput = prompt_tp, generation_tp
        self.aggregate_scheduler_stats()
        self.last_line = self._format_line(prompt_tp, generation_tp)
        # vLLM's second line when speculation ran in the interval (its SpecDecodingLogging)
        self.last_spec_line = self.spec.line(self.log_prefix, elapsed)
        self._reset(now)
        level = logging.DEBUG if self.engine_is_idle else logging.INFO
        logger.log(level, "%s", self.last_line)
        if self.last_spec_line:
            logger.log(level, "%s", self.last_spec_line)

    def _format_line(self, prompt_tp: float, generation_tp: float) -> str:
        stats = self.last_scheduler_stats
        parts = [f"{self.log_prefix}Avg prompt throughput: {prompt_tp:.1f} tokens/s",
                 f"Avg generation throughput: {generation_tp:.1f} tokens/s",
                 f"Running: {stats.num_running_reqs} reqs", f"Waiting: {stats.num_waiting_reqs} reqs"]
        if self.num_preemptions:  # vLLM shows the field only when there were some
            parts.append(f"Preemptions: {self.num_preemptions}")
        parts.append(f"GPU KV cache usage: {stats.kv_cache_usage * 100:.1f}%")
        parts.append(f"Prefix cache hit rate: {self.prefix_cache_hit_rate * 100:.1f}%")
        return ", ".join(parts)

    def log_engine_initialized(self) -> None:
        if num_gpu_blocks := _num_gpu_blocks(self.vllm_config):
            logger.debug("%svllm cache_config_info with initialization after num_gpu_blocks is: %d",
                         self.log_prefix, num_gpu_blocks)


class SpecDecodingInterval:
    """Speculative decoding over one logging interval, as vLLM's SpecDecodingLogging words it."""

    def __init__(self) -> None:
        self.num_drafts = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted_per_pos: list[int] = []

    def add(self, deltas: dict[str, int], accepted_per_pos: list[int]) -> None:
        self.num_drafts += deltas["spec_decode_num_drafts"]
        self.num_draft_tokens += deltas["spec_decode_num_draft_tokens"]
        self.num_accepted_tokens += deltas["spec_decode_num_accepted_tokens"]
        for i, n in enumerate(accepted_per_pos):
            if i == len(self.accepted_per_pos):
                self.accepted_per_pos.append(0)
            self.accepted_per_pos[i] += n

    def line(self, prefix: str, elapsed: float) -> str:
        """"" when nothing was drafted in the interval."""
        if not self.num_drafts:
            return ""
        per_s = 1 / elapsed if elapsed > 0 else 0.0
        rates = ", ".join(f"{n / self.num_drafts:.3f}" for n in self.accepted_per_pos)
        return (f"{prefix}SpecDecoding metrics: Mean acceptance length: "
                f"{1 + self.num_accepted_tokens / self.num_drafts:.2f}, "
                f"Accepted throughput: {self.num_accepted_tokens * per_s:.2f} tokens/s, "
                f"Drafted throughput: {self.num_draft_tokens * per_s:.2f} tokens/s, "
                f"Accepted: {self.num_accepted_tokens} tokens, Drafted: {self.num_draft_tokens} tokens, "
                f"Per-position acceptance rate: {rates}, "
                f"Avg Draft acceptance rate: {100 * self.num_accepted_tokens / max(self.num_draft_tokens, 1):.1f}%")


class AggregatedLoggingStatLogger(LoggingStatLogger, AggregateStatLoggerBase):
    """vLLM's summary line over several engines (`engine_indexes`): throughput summed, running
    and waiting summed over the engines' latest stats, KV usage their mean."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int]) -> None:  # type: ignore[override]
        self.engine_indexes = list(engine_indexes)
        self.last_scheduler_stats_dict: dict[int, SchedulerStats] = {i: SchedulerStats() for i in self.engine_indexes}
        LoggingStatLogger.__init__(self, vllm_config, engine_index=-1)
        self.aggregated = True

    @property
    def log_prefix(self) -> str:
        return f"{len(self.engine_indexes)} Engines Aggregated: "

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        if engine_idx not in self.last_scheduler_stats_dict:
            logger.warning("Unexpected engine_idx: %d", engine_idx)
            return
        LoggingStatLogger.record(self, scheduler_stats, iteration_stats, mm_cache_stats, engine_idx)
        if scheduler_stats is not None:
            self.last_scheduler_stats_dict[engine_idx] = scheduler_stats

    def aggregate_scheduler_stats(self) -> None:
        per_engine = list(self.last_scheduler_stats_dict.values())
        self.last_scheduler_stats = SchedulerStats(
            num_running_reqs=sum(s.num_running_reqs for s in per_engine),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in per_engine),
            kv_cache_usage=sum(s.kv_cache_usage for s in per_engine) / max(len(per_engine), 1))

    def log_engine_initialized(self) -> None:
        if num_gpu_blocks := _num_gpu_blocks(self.vllm_config):
            logger.info("%d Engines: vllm cache_config_info with initialization after num_gpu_blocks is: %d",
                        len(self.engine_indexes), num_gpu_blocks)


class PerEngineStatLoggerAdapter(AggregateStatLoggerBase):
    """vLLM's adapter: one logger per engine from a per-engine factory, each fed its engine's records."""

    def __init__(self, vllm_config: Any, engine_indexes: list[int],  # type: ignore[override]
                 per_engine_stat_logger_factory: PerEngineStatLoggerFactory) -> None:
        self.engine_indexes = list(engine_indexes)
        self.per_engine_stat_loggers: dict[int, StatLoggerBase] = {
            i: per_engine_stat_logger_factory(vllm_config, i) for i in self.engine_indexes}

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        stat_logger = self.per_engine_stat_loggers.get(engine_idx)
        if stat_logger is None:
            logger.warning("Unexpected engine_idx: %d", engine_idx)
            return
        stat_logger.record(scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats, engine_idx=engine_idx)

    def log(self) -> None:
        for stat_logger in self.per_engine_stat_loggers.values():
            stat_logger.log()

    def log_engine_initialized(self) -> None:
        for stat_logger in self.per_engine_stat_loggers.values():
            stat_logger.log_engine_initialized()

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:
        for stat_logger in self.per_engine_stat_loggers.values():
            stat_logger.record_sleep_state(is_awake, level)
