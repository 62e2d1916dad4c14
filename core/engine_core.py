"""EngineCore: the step logic (schedule -> execute -> update), free of any process concerns.

The engine-core process (core/core_proc.py) wraps one of these in a busy loop with IO threads;
the in-process client calls it directly.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from tidal.core.executor import Executor
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler import Scheduler
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
)

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        self.executor = executor or Executor.create(config)
        try:
            self.info: ResolvedEngineInfo = self.executor.initialize()
        except BaseException:
            self.executor.shutdown()
            raise
        capacity = self.info.num_kv_blocks * self.info.block_size
        if capacity < self.info.max_model_len:
            self.executor.shutdown()
            raise ValueError(
                f"the KV cache holds {capacity} tokens ({self.info.num_kv_blocks} blocks of "
                f"{self.info.block_size}), fewer than max_model_len={self.info.max_model_len}: "
                "raise num_kv_blocks / kv_cache_memory_bytes or lower max_model_len"
            )
        self.scheduler = Scheduler.from_config(config, self.info.num_kv_blocks, self.info.max_model_len)
        # Prompt-logprob rows already emitted per request: a request preempted mid-prefill
        # recomputes its prompt, and those rows must not reach the user twice.
        self._prompt_lp_done: dict[str, int] = {}
        self.forward_time_s = 0.0
        self.step_time_s = 0.0
        self.num_steps = 0
        self._utilities: dict[str, Callable[..., Any]] = {
            "get_stats": lambda: self.scheduler.make_stats(),
            "reset_prefix_cache": self.scheduler.reset_prefix_cache,
            "get_info": lambda: self.info,
            "num_unfinished_requests": self.scheduler.get_num_unfinished_requests,
            "get_timing": lambda: (self.step_time_s, self.forward_time_s, self.num_steps),
            "ping": lambda: "pong",
        }

    # ------------------------------------------------------------------ requests
    def validate_request(self, req: EngineCoreRequest) -> str | None:
        """The front-end validates first; this guards the core against any other client."""
        n = len(req.prompt_token_ids)
        if n == 0:
            return "prompt is empty"
        if n >= self.info.max_model_len:
            return f"prompt length {n} must be less than max_model_len {self.info.max_model_len}"
        max_tokens = req.sampling_params.max_tokens
        if max_tokens is not None and n + max_tokens > self.info.max_model_len:
            return (f"prompt length {n} + max_tokens {max_tokens} exceeds max_model_len "
                    f"{self.info.max_model_len}")
        vocab = self.info.vocab_size
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= vocab:
            return f"prompt token ids must be in [0, {vocab})"
        for k in (req.sampling_params.logprobs, req.sampling_params.prompt_logprobs):
            if k is not None and k > self.config.max_logprobs:
                return f"requested {k} logprobs, more than max_logprobs {self.config.max_logprobs}"
        if req.sampling_params.n != 1:
            return "the engine core takes n=1 requests; the front-end fans out n > 1"
        return None

    def add_request(self, req: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; an invalid one is not queued and gets an ERROR output back."""
        problem = self.validate_request(req)
        if problem is None and req.request_id in self.scheduler.requests:
            problem = f"request id {req.request_id!r} is already running"
        if problem is not None:
            return EngineCoreOutput(req.request_id, finish_reason=FinishReason.ERROR, error=problem)
        self.scheduler.add_request(Request.from_engine_core_request(req, self.info.max_model_len))
        return None

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort; returns one finished ABORT output per request that was still known."""
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for r in aborted:
            self._prompt_lp_done.pop(r.request_id, None)
        return [
            EngineCoreOutput(r.request_id, finish_reason=FinishReason.ABORT,
                             num_cached_tokens=max(r.num_cached_tokens, 0))
            for r in aborted
        ]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ---------------------------------------------------------------------- step
    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(timestamp=time.monotonic())
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            outputs: list[EngineCoreOutput] = []
        else:
            runner_output = self.executor.execute_model(scheduler_output)
            self.forward_time_s += runner_output.forward_time_s
            if runner_output.prompt_logprobs:
                self._dedupe_prompt_logprobs(scheduler_output, runner_output)
            outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
            for out in outputs:
                if out.finish_reason is not None:
                    self._prompt_lp_done.pop(out.request_id, None)
        self.step_time_s += time.perf_counter() - t0
        self.num_steps += 1
        stats = None if self.config.disable_log_stats else self.scheduler.make_stats()
        return EngineCoreOutputs(outputs=outputs, scheduler_stats=stats, timestamp=time.monotonic())

    def _dedupe_prompt_logprobs(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> None:
        starts = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        starts.update((c.req_id, c.num_computed_tokens) for c in so.scheduled_cached_reqs)
        for rid, arrays in list(ro.prompt_logprobs.items()):
            # Row i is the logprob of prompt token (start + i + 1).
            start, done = starts[rid], self._prompt_lp_done.get(rid, 0)
            skip = max(0, done - start)
            if skip >= len(arrays.ranks):
                del ro.prompt_logprobs[rid]
                continue
            if skip:
                arrays = type(arrays)(arrays.token_ids[skip:], arrays.logprobs[skip:], arrays.ranks[skip:])
                ro.prompt_logprobs[rid] = arrays
            self._prompt_lp_done[rid] = start + skip + len(arrays.ranks)

    # ------------------------------------------------------------------ utility
    def call_utility(self, method: str, args: list[Any]) -> Any:
        fn = self._utilities.get(method)
        if fn is None:
            raise ValueError(f"unknown utility method {method!r}; known: {sorted(self._utilities)}")
        return fn(*args)

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
