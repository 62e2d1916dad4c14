"""Per-step and per-request statistics (vLLM V1's vllm/v1/metrics/stats.py).

The front-end makes one `IterationStats` per `EngineCoreOutputs` message, feeds it each
`EngineCoreOutput` it accepts for a request it tracks (`update_from_output`) and each request
it finishes (`update_from_finished_request`), then hands it to the stat loggers with the
message's `SchedulerStats`. Everything is counted from the front-end's own outputs, so a token
is counted once, when it is delivered, and never one the front-end dropped (e.g. after a stop
string ended the request here).

Clocks, as vLLM's: `arrival_time` and `iteration_timestamp` are this process's wall clock
(`time.time()`), so TTFT and e2e latency are measured where the user sees them; `queued_ts`,
`scheduled_ts`, `first_token_ts` and `last_token_ts` are the core's `time.monotonic()` (its
events and its `EngineCoreOutputs.timestamp`), so queue, prefill, decode and inter-token
intervals are differences within one clock even when the core runs on another host.

The stat-logger interface (`StatLoggerBase`, `AggregateStatLoggerBase`) is vLLM's
(vllm/v1/metrics/loggers.py), so a logger written for vLLM runs unchanged as a `stat_loggers`
factory; the loggers themselves are in tidal.frontend.metrics (`tidal.v1.metrics.loggers`).
"""
from __future__ import annotations

import time
from abc import ABC, ABCMeta, abstractmethod
from dataclasses import dataclass
from typing import Any

from tidal.protocol.messages import EngineCoreEventType, EngineCoreOutput, FinishReason, SchedulerStats
from tidal.protocol.outputs import RequestStateStats

_QUEUED = int(EngineCoreEventType.QUEUED)
_SCHEDULED = int(EngineCoreEventType.SCHEDULED)
_PREEMPTED = int(EngineCoreEventType.PREEMPTED)


@dataclass
class FinishedRequestStats:
    """One finished request, with vLLM's field names; intervals in seconds."""

    finish_reason: str  # "stop" | "length" | "abort" | "error": the `finished_reason` label
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    mean_time_per_output_token: float = 0.0
    num_cached_tokens: int = 0


class IterationStats:
    """What one engine step (one `EngineCoreOutputs` message) delivered to this front-end."""

    def __init__(self, iteration_timestamp: float | None = None) -> None:
        # Wall clock at which the front-end processes the step (tests pass their own).
        self.iteration_timestamp = time.time() if iteration_timestamp is None else iteration_timestamp
        self.num_generation_tokens = 0
        self.num_prompt_tokens = 0  # whole prompts, counted at each request's first token
        self.num_cached_prompt_tokens = 0  # of those, found in the prefix cache
        self.num_preempted_reqs = 0  # PREEMPTED events seen on this front-end's requests
        self.num_corrupted_reqs = 0  # vLLM's (NaNs in logits, under VLLM_COMPUTE_NANS_IN_LOGITS): never here
        self.finished_requests: list[FinishedRequestStats] = []
        self.time_to_first_tokens_iter: list[float] = []
        self.inter_token_latencies_iter: list[float] = []
        # One entry per user request (an n > 1 request's children together) that finished in
        # this step, as vLLM's: its `n`, and the most tokens any of its samples generated.
        self.n_params_iter: list[int] = []
        self.max_num_generation_tokens_iter: list[int] = []

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens the core had to compute (not found in the prefix cache)."""
        return self.num_prompt_tokens - self.num_cached_prompt_tokens

    @property
    def prompt_token_stats(self) -> PromptTokenStats:
        """vLLM's breakdown of this step's prompt tokens by source (tidal has no external KV
        transfer: those are 0)."""
        cached = self.num_cached_prompt_tokens
        return PromptTokenStats(computed=self.num_prompt_tokens - cached, local_cache_hit=cached,
                                cached_tokens=cached, total=self.num_prompt_tokens)

    def update_from_output(self, output: EngineCoreOutput, engine_core_timestamp: float,
                           prompt_len: int, req_stats: RequestStateStats) -> None:
        """Count one accepted core output of a tracked (child) request and advance its
        `req_stats` (which then serve as `RequestOutput.metrics`). `engine_core_timestamp` is
        the message's `EngineCoreOutputs.timestamp`; `prompt_len` the request's prompt length.
        An output without new tokens (a prompt-logprobs chunk, a bare finish) only records
        its events: a request's first token is its first output that carries tokens."""
        if output.events:
            self._update_from_events(output.events, req_stats)
        num_new = len(output.new_token_ids)
        if not num_new:
            return
        self.num_generation_tokens += num_new
        if req_stats.num_generation_tokens == 0:
            self._first_token(output, engine_core_timestamp, prompt_len, req_stats)
        else:
            # A restarted core on another host restarts its monotonic clock: one interval
            # across the restart may come out negative, and no latency is below zero.
            self.inter_token_latencies_iter.append(max(0.0, engine_core_timestamp - req_stats.last_token_ts))
        req_stats.last_token_ts = engine_core_timestamp
        req_stats.num_generation_tokens += num_new

    def _first_token(self, output: EngineCoreOutput, engine_core_timestamp: float, prompt_len: int,
                     req_stats: RequestStateStats) -> None:
        # The prompt counts once per request, when its prefill ended in a token: a request
        # resubmitted after a core restart keeps its stats and is not counted again.
        self.num_prompt_tokens += prompt_len
        self.num_cached_prompt_tokens += min(max(output.num_cached_tokens, 0), prompt_len)
        ttft = self.iteration_timestamp - req_stats.arrival_time
        self.time_to_first_tokens_iter.append(ttft)
        req_stats.first_token_latency = ttft
        req_stats.first_token_ts = engine_core_timestamp

    def _update_from_events(self, events: list[tuple[int, float]], req_stats: RequestStateStats) -> None:
        for event, ts in events:
            if event == _QUEUED:
                req_stats.queued_ts = ts
            elif event == _SCHEDULED:
                if not req_stats.scheduled_ts:  # the first scheduling; later ones follow preemptions
                    req_stats.scheduled_ts = ts
            elif event == _PREEMPTED:
                self.num_preempted_reqs += 1

    def update_from_finished_request(self, finish_reason: FinishReason | str, num_prompt_tokens: int,
                                     max_tokens_param: int | None, req_stats: RequestStateStats,
                                     num_cached_tokens: int = 0, *, n_param: int = 1,
                                     group_finished: bool = True, group_max_generation_tokens: int = 0) -> None:
        """Record a (child) request the front-end finished, once, whatever ended it (the
        core's finish, a stop string found here, a user abort, an error). Call it after
        `update_from_output` for the finishing output, so its last tokens are in `req_stats`.

        The request parameters (vLLM's `request_params_n`, `request_max_num_generation_tokens`)
        are per user request: for a child of an n > 1 request pass `n_param=n`, whether it is
        the last of its siblings to finish (`group_finished`) and the most tokens its finished
        siblings generated (`group_max_generation_tokens`); the defaults describe a lone request."""
        first, last = req_stats.first_token_ts, req_stats.last_token_ts
        decode_time = _interval(first, last)
        num_tokens = req_stats.num_generation_tokens
        self.finished_requests.append(FinishedRequestStats(
            finish_reason=str(finish_reason),
            e2e_latency=max(0.0, self.iteration_timestamp - req_stats.arrival_time),
            num_prompt_tokens=num_prompt_tokens,
            num_generation_tokens=num_tokens,
            max_tokens_param=max_tokens_param,
            queued_time=_interval(req_stats.queued_ts, req_stats.scheduled_ts),
            prefill_time=_interval(req_stats.scheduled_ts, first),
            inference_time=_interval(req_stats.scheduled_ts, last),
            decode_time=decode_time,
            # The first token closes the prefill: the decode phase made the other n - 1.
            mean_time_per_output_token=decode_time / (num_tokens - 1) if num_tokens > 1 else 0.0,
            num_cached_tokens=max(num_cached_tokens, 0),
        ))
        if group_finished:
            self.n_params_iter.append(n_param)
            self.max_num_generation_tokens_iter.append(max(num_tokens, group_max_generation_tokens))


def _interval(start: float, end: float) -> float:
    """`end - start`, or 0 when either stamp never came (a request aborted while waiting
    has no SCHEDULED stamp, one without tokens no token stamps): a missing phase lasted
    nothing rather than a negative or epoch-sized time."""
    if not start or not end:
        return 0.0
    return max(0.0, end - start)


@dataclass
class PromptTokenStats:
    """vLLM's breakdown of prompt tokens by source: `computed` + `local_cache_hit` +
    `external_kv_transfer` = `total`; `cached_tokens` = the two cached sources."""

    ALL_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")  # vLLM's label values

    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    cached_tokens: int = 0
    recomputed_tokens: int = 0
    total: int = 0

    def get_by_source(self, source: str) -> int:
        if source == "local_compute":
            return self.computed
        if source == "local_cache_hit":
            return self.local_cache_hit
        if source == "external_kv_transfer":
            return self.external_kv_transfer
        raise ValueError(f"unknown prompt token source {source!r}")


class StatLoggerBase(ABC):
    """vLLM's stat-logger interface (vllm/v1/metrics/loggers.py): built by a factory called
    with `(vllm_config, engine_index)` (a user's `stat_loggers=[...]` entry, e.g. the class
    itself), `record` once per engine step (and for requests finished outside a step, then
    with `scheduler_stats=None`), `log_engine_initialized` once the engine is up, `log`
    periodically (vLLM's `do_log_stats`). As in vLLM, `SchedulerStats` and `IterationStats` are
    not a stable interface."""

    @abstractmethod
    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        ...

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        ...

    @abstractmethod
    def log_engine_initialized(self) -> None:
        ...

    def log(self) -> None:  # optional, as in vLLM
        pass

    def record_sleep_state(self, is_awake: int = 0, level: int = 0) -> None:  # optional, as in vLLM
        pass


class _EngineIndexesMeta(ABCMeta):
    """Lets an aggregate logger class be a plain `stat_loggers` factory: called with
    `(vllm_config, engine_index)` as every factory is, it gets vLLM's `engine_indexes` list."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if len(args) >= 2 and isinstance(args[1], int):
            args = (args[0], [args[1]], *args[2:])
        if isinstance(kwargs.get("engine_indexes"), int):
            kwargs["engine_indexes"] = [kwargs["engine_indexes"]]
        if "engine_index" in kwargs and "engine_indexes" not in kwargs:
            kwargs["engine_indexes"] = [kwargs.pop("engine_index")]
        return super().__call__(*args, **kwargs)


class AggregateStatLoggerBase(StatLoggerBase, metaclass=_EngineIndexesMeta):
    """vLLM's logger for several engines at once (data parallel ranks), built with
    `(vllm_config, engine_indexes)`; `record`'s `engine_idx` says which engine a record is of."""

    @abstractmethod
    def __init__(self, vllm_config: Any, engine_indexes: list[int]) -> None:  # type: ignore[override]
        ...


class CoreCounterDeltas:
    """Turns the core's cumulative `SchedulerStats` counters into per-message increments (what
    a Prometheus counter takes). A restarted core counts from zero again: when any of its
    counters goes back, the new values are all new."""

    COUNTED = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "spec_decode_num_drafts",
               "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens")
    # Also watched for a restart: a field that stays 0 on both cores cannot reveal one.
    _WATCHED = COUNTED + ("num_prompt_tokens", "num_generation_tokens")

    def __init__(self) -> None:
        self._last = dict.fromkeys(self._WATCHED, 0)
        self._last_per_pos: list[int] = []
        # The per-position increments of `spec_decode_num_accepted_tokens_per_pos` of the last update.
        self.accepted_per_pos: list[int] = []

    def update(self, stats: SchedulerStats) -> dict[str, int]:
        current = {name: getattr(stats, name) for name in self._WATCHED}
        per_pos = list(getattr(stats, "spec_decode_num_accepted_tokens_per_pos", None) or [])
        restarted = any(current[name] < self._last[name] for name in self._WATCHED) or any(
            now < before for now, before in zip(per_pos, self._last_per_pos))
        base = dict.fromkeys(self._WATCHED, 0) if restarted else self._last
        base_pos = [] if restarted else self._last_per_pos
        self._last = current
        self._last_per_pos = per_pos
        self.accepted_per_pos = [n - (base_pos[i] if i < len(base_pos) else 0) for i, n in enumerate(per_pos)]
        return {name: current[name] - base[name] for name in self.COUNTED}
