"""The holders of an engine's stat loggers: vLLM's `StatLoggerManager`, for code that builds one
itself, and `EngineMetrics`, what tidal's front-end holds per engine (the Prometheus metric set,
the stats log line and the user's loggers, all fed by `record`). The metric set and the loggers
are in metrics.py; both names are importable from there too."""
from __future__ import annotations

import asyncio
import copy
import logging
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import prometheus_client as prom

from tidal.frontend.metrics import MULTIPROC_DIR_ENV, PrometheusStatLogger, StatLoggerFactory
from tidal.frontend.metrics_logging import AggregatedLoggingStatLogger, LoggingStatLogger, PerEngineStatLoggerAdapter
from tidal.frontend.metrics_reader import VLLM_PREFIX, Metric, get_metrics_snapshot
from tidal.frontend.metrics_stats import AggregateStatLoggerBase, IterationStats, StatLoggerBase
from tidal.protocol.messages import SchedulerStats

logger = logging.getLogger("tidal.frontend.metrics")  # the one the metrics' messages have always had


class StatLoggerManager:
    """vLLM's manager of an engine's stat loggers, for code that builds one itself: `custom_stat_loggers`
    (an AggregateStatLoggerBase subclass is built once for all engines, any other factory once
    per engine, behind a PerEngineStatLoggerAdapter), vLLM's default LoggingStatLogger (or the
    aggregated one) while INFO logging is on, and a PrometheusStatLogger unless one of the
    custom ones is. (tidal's front-end uses EngineMetrics, which holds the same loggers.)"""

    def __init__(self, vllm_config: Any, engine_idxs: list[int] | None = None,
                 custom_stat_loggers: list[StatLoggerFactory] | None = None, enable_default_loggers: bool = True,
                 aggregate_engine_logging: bool = False, client_count: int = 1) -> None:
        self.engine_indexes = list(engine_idxs) if engine_idxs else [0]
        self.stat_loggers: list[AggregateStatLoggerBase] = []
        factories: list[StatLoggerFactory] = list(custom_stat_loggers or [])
        if enable_default_loggers and logger.isEnabledFor(logging.INFO):
            if client_count > 1:
                logger.warning("AsyncLLM created with api_server_count more than 1; "
                               "disabling stats logging to avoid incomplete stats.")
            else:
                factories.append(AggregatedLoggingStatLogger if aggregate_engine_logging else LoggingStatLogger)
        custom_prometheus = False
        for factory in factories:
            stat_logger: AggregateStatLoggerBase
            if isinstance(factory, type) and issubclass(factory, AggregateStatLoggerBase):
                stat_logger = factory(vllm_config=vllm_config, engine_indexes=self.engine_indexes)
                custom_prometheus = custom_prometheus or isinstance(stat_logger, PrometheusStatLogger)
            else:
                stat_logger = PerEngineStatLoggerAdapter(vllm_config, self.engine_indexes, factory)
            self.stat_loggers.append(stat_logger)
        if not custom_prometheus:
            self.stat_loggers.append(PrometheusStatLogger(vllm_config, self.engine_indexes))

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int | None = None) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record(scheduler_stats, iteration_stats, mm_cache_stats=mm_cache_stats,
                               engine_idx=0 if engine_idx is None else engine_idx)

    def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.record_sleep_state(sleep, level)

    def log(self) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.log()

    def log_engine_initialized(self) -> None:
        for stat_logger in self.stat_loggers:
            stat_logger.log_engine_initialized()


class EngineMetrics:
    """One engine's metrics as tidal's front-end holds them: the Prometheus metric set
    (`registry`, vLLM's names), the one-line stats log, and any extra `StatLoggerBase` (a
    user's `stat_loggers`, already built), all fed by `record`. A user's PrometheusStatLogger
    (subclass) replaces the built-in one, as in vLLM. With `vllm_config` (the engine's config,
    limits resolved) the metrics include `cache_config_info`. See the module docstring."""

    def __init__(self, model_name: str, max_model_len: int, *, prefix: str = VLLM_PREFIX,
                 engine_index: int = 0, log_interval_s: float = 10.0,
                 stat_loggers: Sequence[StatLoggerBase] = (), vllm_config: Any = None,
                 engine_indexes: Sequence[int] | None = None,
                 engine_stat_loggers: Mapping[int, Sequence[StatLoggerBase]] | None = None) -> None:
        """`engine_indexes`: the data-parallel engines (default [engine_index]); `stat_loggers`
        are the first engine's user loggers, `engine_stat_loggers` the others' (vLLM builds
        a user logger per engine); each gets the records of its own engine only."""
        engines = [engine_index] if engine_indexes is None else list(engine_indexes)
        self.engine_index = engines[0]
        self._user_by_engine: dict[int, list[StatLoggerBase]] = {i: [] for i in engines}
        self._user_by_engine[engines[0]] = list(stat_loggers)
        for i, loggers in (engine_stat_loggers or {}).items():
            self._user_by_engine[i] = list(loggers)
        self.user_loggers: list[StatLoggerBase] = [s for i in engines for s in self._user_by_engine[i]]
        custom = [s for s in self.user_loggers if isinstance(s, PrometheusStatLogger)]
        self.prometheus: PrometheusStatLogger = custom[0] if custom else PrometheusStatLogger(
            vllm_config, engines, model_name=model_name, max_model_len=max_model_len, prefix=prefix)
        self._log_lines = {i: LoggingStatLogger(vllm_config, i) for i in engines}  # one line per engine
        self.logging = self._log_lines[engines[0]]
        self.log_interval_s = log_interval_s
        self._next_log = time.monotonic() + log_interval_s
        self._failed: set[int] = set()  # id() of each user logger whose first failure was logged
        self.log_engine_initialized()

    @property
    def registry(self) -> prom.CollectorRegistry:
        """For the server: `prometheus_client.generate_latest(metrics.registry)`. One of several
        API servers (`--api-server-count`, prometheus_client's multiprocess mode): a registry
        that collects every server's values from the shared directory."""
        if MULTIPROC_DIR_ENV in os.environ:
            from prometheus_client import multiprocess

            registry = prom.CollectorRegistry()
            multiprocess.MultiProcessCollector(registry)
            return registry
        return self.prometheus.registry

    @property
    def prefix(self) -> str:
        """The prefix of the vLLM-named metrics ("vllm:")."""
        return self.prometheus.prefix

    def _builtins(self) -> list[StatLoggerBase]:
        lines: list[StatLoggerBase] = list(self._log_lines.values())
        return lines if self.prometheus in self.user_loggers else [self.prometheus, *lines]

    def log_engine_initialized(self) -> None:
        """vLLM's call once the engine is up (the built-in loggers' and each user logger's)."""
        for stat_logger in self._builtins():
            stat_logger.log_engine_initialized()
        for stat_logger in self.user_loggers:
            self._call_user_logger(stat_logger, "log_engine_initialized")

    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               engine_idx: int | None = None) -> None:
        """Once per `EngineCoreOutputs` message (its `scheduler_stats`, None when it had none),
        and with `scheduler_stats=None` for requests finished outside a step (user aborts)."""
        idx = self.engine_index if engine_idx is None else engine_idx
        if idx not in self._log_lines:
            logger.warning("Unexpected engine_idx: %d", idx)
            return
        builtins = [self._log_lines[idx]]
        if self.prometheus not in self.user_loggers:
            builtins.insert(0, self.prometheus)
        for stat_logger in builtins:
            stat_logger.record(scheduler_stats, iteration_stats, None, idx)
        # vLLM's defaults (mm_cache_stats None, engine_idx 0) are left to the logger's signature,
        # so one written for an older vLLM (record(scheduler_stats, iteration_stats)) runs too.
        extra = {} if idx == 0 else {"engine_idx": idx}
        for stat_logger in self._user_by_engine[idx]:
            # Each user logger gets copies: one that edits its stats (or keeps and edits them
            # later) cannot change what the built-in loggers hold, or what another logger sees.
            self._call_user_logger(stat_logger, "record", copy.deepcopy(scheduler_stats),
                                   copy.deepcopy(iteration_stats), **extra)

    def record_core_restart(self, engine_idx: int | None = None) -> None:
        self.prometheus.record_core_restart(self.engine_index if engine_idx is None else engine_idx)

    def log(self) -> None:
        """Every logger's periodic output now (vLLM's `do_log_stats()`)."""
        self._next_log = time.monotonic() + self.log_interval_s
        for stat_logger in self._builtins():
            stat_logger.log()
        for stat_logger in self.user_loggers:
            self._call_user_logger(stat_logger, "log")

    def _call_user_logger(self, stat_logger: StatLoggerBase, method: str, *args: Any, **kwargs: Any) -> None:
        """A user's stat logger that raises loses that call, never the engine: these calls run
        in the front-end's output handler (LLM's step loop), where an exception would end every
        stream. Its first failure is logged with the traceback; it is still called after.
        A CancelledError raised inside this synchronous call is the logger's own (a real
        cancellation of the output handler arrives at an await, never in here): caught too.
        A method it lacks (a duck-typed logger without log_engine_initialized) is skipped."""
        fn = getattr(stat_logger, method, None)
        if fn is None:
            return
        try:
            fn(*args, **kwargs)
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
        """vLLM's `LLM.get_metrics()`: every vLLM metric as a reader record named `vllm:...`."""
        return get_metrics_snapshot(self.registry, self.prefix)
