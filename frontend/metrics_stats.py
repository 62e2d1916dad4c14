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
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

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
        self.finished_requests: list[FinishedRequestStats] = []
        self.time_to_first_tokens_iter: list[float] = []
        self.inter_token_latencies_iter: list[float] = []

    @property
    def num_computed_prompt_tokens(self) -> int:
        """Prompt tokens the core had to compute (not found in the prefix cache)."""
        return self.num_prompt_tokens - self.num_cached_prompt_tokens

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
                                     num_cached_tokens: int = 0) -> None:
        """Record a (child) request the front-end finished, once, whatever ended it (the
        core's finish, a stop string found here, a user abort, an error). Call it after
        `update_from_output` for the finishing output, so its last tokens are in `req_stats`."""
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


def _interval(start: float, end: float) -> float:
    """`end - start`, or 0 when either stamp never came (a request aborted while waiting
    has no SCHEDULED stamp, one without tokens no token stamps): a missing phase lasted
    nothing rather than a negative or epoch-sized time."""
    if not start or not end:
        return 0.0
    return max(0.0, end - start)


class StatLoggerBase(ABC):
    """vLLM's stat-logger interface: `record` once per engine step (and for requests finished
    outside a step), `log` periodically. A user's `stat_loggers=[...]` factory returns one."""

    @abstractmethod
    def record(self, scheduler_stats: SchedulerStats | None, iteration_stats: IterationStats | None,
               mm_cache_stats: object | None = None, engine_idx: int = 0) -> None:
        ...

    def log(self) -> None:  # optional, as in vLLM
        pass

    def log_engine_initialized(self) -> None:
        pass


class CoreCounterDeltas:
    """Turns the core's cumulative `SchedulerStats` counters into per-message increments (what
    a Prometheus counter takes). A restarted core counts from zero again: when any of its
    counters goes back, the new values are all new."""

    COUNTED = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")
    # Also watched for a restart: a field that stays 0 on both cores cannot reveal one.
    _WATCHED = COUNTED + ("num_prompt_tokens", "num_generation_tokens")

    def __init__(self) -> None:
        self._last = dict.fromkeys(self._WATCHED, 0)

    def update(self, stats: SchedulerStats) -> dict[str, int]:
        current = {name: getattr(stats, name) for name in self._WATCHED}
        restarted = any(current[name] < self._last[name] for name in self._WATCHED)
        base = dict.fromkeys(self._WATCHED, 0) if restarted else self._last
        self._last = current
        return {name: current[name] - base[name] for name in self.COUNTED}
