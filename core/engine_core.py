"""EngineCore: the step logic (schedule -> execute -> update), free of any process concerns.

The engine-core process (core/core_proc.py) wraps one of these in a busy loop with IO threads;
the in-process client calls it directly.

Invariants:
- Every output leaves through `step()`, grouped by the front-end it goes to (the request's
  `client_index`): step outputs, rejections of `add_request` and the ABORT outputs of
  `abort_requests` alike. Each request gets exactly one finished output.
- Request ids are the front-end's own: requests are keyed by (front-end, id), so two
  front-ends may use the same ids and neither can touch (abort, block) the other's. The
  scheduler and runner see an internal id (`internal_id`) that is unique per core; outputs
  leave with the front-end's id again.
- `apply_input` (the core process's input drain) runs between the forward pass and the update
  that builds the step's outputs, so an abort that arrived during the forward pass wins over
  it: the request gets its one ABORT output, and the tokens of the step it raced are dropped.
- Before the forward pass of a request's first step on this core, its front-end gets a
  "started" output (no tokens, its SCHEDULED event) through `announce` when one is given (the
  core process sends it at once): a core that vanishes mid-step names no failing step, and the
  front-end then blames only the requests it knows had started (frontend/recovery.py triage).
- A step that raises leaves `_step_in_flight` set: `failed_step_request_ids` then names each
  front-end's requests that were in it, for the `engine_dead` message (the front-end
  quarantines them on the next core: frontend/recovery.py triage).
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable

from tidal.core.executor import Executor
from tidal.core.request import ClientIndex, Request, RequestStatus
from tidal.core.scheduler import Scheduler
from tidal.core.structured_output import GrammarFailure, StructuredOutputManager
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.messages import (
    EngineCoreEventType,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ErrorKind,
    FinishReason,
    SchedulerOutput,
)
from tidal.protocol.request_rules import RequestLimits, check_request
from tidal.utils.logging_utils import summarize_exception

logger = logging.getLogger(__name__)
_GRAMMAR_POLL_S = 0.05  # longest sleep of an idle step waiting for a grammar (inputs wait meanwhile)


def internal_id(request_id: str, client_index: ClientIndex) -> str:
    """The scheduler's id of a front-end's request: unique per core. A client's id followed
    by NUL and its identity in hex (which holds no NUL), so the last NUL splits it back and
    no two (front-end, id) pairs share one. In-process callers (None) keep their ids."""
    return request_id if client_index is None else f"{request_id}\x00{client_index.hex()}"


def external_id(internal: str, client_index: ClientIndex) -> str:
    return internal if client_index is None else internal.rpartition("\x00")[0]


def client_of(internal: str) -> ClientIndex:
    """The front-end an internal id names (internal_id's inverse; None: an in-process caller's
    id, or one that does not parse)."""
    _, sep, client_hex = internal.rpartition("\x00")
    try:
        return bytes.fromhex(client_hex) if sep else None
    except ValueError:
        return None


class EngineCore:
    def __init__(self, config: EngineConfig, executor: Executor | None = None, *,
                 apply_input: Callable[[], None] | None = None,
                 announce: Callable[[dict[ClientIndex, EngineCoreOutputs]], None] | None = None) -> None:
        self.config = config
        self.executor = executor or Executor.create(config)
        try:
            self.info: ResolvedEngineInfo = self.executor.initialize()
            self.scheduler = Scheduler.from_config(config, self.info.num_kv_blocks, self.info.max_model_len)
        except BaseException:
            self.executor.shutdown()
            raise
        self.limits = RequestLimits(self.info.max_model_len, self.info.vocab_size, config.max_logprobs,
                                    config.scheduling_policy)
        # Grammars of structured-output requests (xgrammar loads on the first such request).
        self.structured_output_manager = StructuredOutputManager(config, self.info.vocab_size)
        self.apply_input = apply_input
        self.announce = announce  # sends "started" outputs ahead of a step (see the invariants)
        self._outbox: dict[ClientIndex, list[EngineCoreOutput]] = {}  # what the next step() returns
        # Set once the core drains to shut down: every new request is refused with this text.
        self._refusing: str | None = None
        self.forward_time_s = 0.0
        self.step_time_s = 0.0
        self.num_steps = 0
        self._step_in_flight: SchedulerOutput | None = None  # set while a step runs (see invariants)
        self._utilities: dict[str, Callable[..., Any]] = {
            "get_stats": self.scheduler.make_stats,
            "reset_prefix_cache": self.scheduler.reset_prefix_cache,
            "get_timing": lambda: (self.step_time_s, self.forward_time_s, self.num_steps),
        }

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineCoreRequest, client_index: ClientIndex = None) -> None:
        """Queue a request from `client_index`; one that breaks a rule is not queued and gets an
        ERROR output instead (the front-end checked first; this guards against any client)."""
        kind = ErrorKind.REQUEST
        # Refused first (cheap, and an overloaded core should spend nothing on the request).
        problem = self._refusal()
        if problem is not None:
            kind = ErrorKind.OVERLOADED
        elif (problem := self._check(req, client_index)) is not None:
            kind = ErrorKind.INVALID
        if problem is None:
            request: Request | None = None
            try:
                request = Request.from_engine_core_request(req, self.info.max_model_len, client_index)
                request.request_id = internal_id(req.request_id, client_index)
                if req.sampling_params.structured_outputs is not None:
                    self.structured_output_manager.grammar_init(request)  # compiles off the loop
                self.scheduler.add_request(request)
                return
            except Exception as e:  # a request that breaks the scheduler fails alone
                logger.exception("add_request(%r) failed", req.request_id)
                problem = summarize_exception(e)
                if request is not None:  # its compile, if one started, is not waited for
                    self.structured_output_manager.release([request])
        self._emit(client_index, EngineCoreOutput(req.request_id, finish_reason=FinishReason.ERROR, error=problem,
                                                  error_kind=kind))

    def _refusal(self) -> str | None:
        """Why a new request is refused before it is even checked (admission control), if it is."""
        if self._refusing is not None:
            return self._refusing
        limit = self.config.max_waiting_requests
        # Requests held back for their grammar are not waiting for a seat: they do not count.
        waiting = len(self.scheduler.waiting) - self.structured_output_manager.num_waiting_for_grammar()
        if limit is not None and waiting >= limit:
            return (f"engine overloaded: {waiting} requests waiting (max_waiting_requests={limit}); "
                    "retry later")
        return None

    def stop_accepting(self, reason: str) -> None:
        """Refuse every new request from now on with `reason` (a draining core); the requests
        already queued or running go on."""
        self._refusing = reason

    def _check(self, req: EngineCoreRequest, client_index: ClientIndex) -> str | None:
        if internal_id(req.request_id, client_index) in self.scheduler.requests:
            return f"request id {req.request_id!r} is already running"
        if req.sampling_params.n != 1:
            return "the engine core takes n=1 requests; the front-end fans out n > 1"
        resumed = req.resumed_output_token_ids
        if resumed and req.sampling_params.max_tokens is not None and len(resumed) >= req.sampling_params.max_tokens:
            return f"a resumed request has {len(resumed)} tokens already, max_tokens is {req.sampling_params.max_tokens}"
        # A resumed request's tokens so far obey the prompt's rules (vocabulary, context window).
        tokens = req.prompt_token_ids + resumed if resumed else req.prompt_token_ids
        return check_request(tokens, req.sampling_params, self.limits, req.eos_token_id, req.priority)

    def abort_requests(self, request_ids: list[str], client_index: ClientIndex = None) -> None:
        """Abort those of `request_ids` that `client_index` sent and that are still running;
        each gets one finished ABORT output. Other ids are ignored."""
        mine = [internal_id(rid, client_index) for rid in request_ids]  # nobody else's by construction
        ended = self.scheduler.finish_requests(mine, RequestStatus.FINISHED_ABORTED)
        self.structured_output_manager.release(ended)  # stops a compile nobody waits for any more
        for r in ended:
            self._emit(r.client_index, EngineCoreOutput(
                external_id(r.request_id, r.client_index), finish_reason=FinishReason.ABORT,
                num_cached_tokens=max(r.num_cached_tokens, 0)))

    def drop_client(self, client_index: ClientIndex) -> int:
        """A front-end is gone: end its requests and free their KV, without outputs (nobody
        would read them). Returns how many requests it had."""
        mine = [rid for rid, r in self.scheduler.requests.items() if r.client_index == client_index]
        self.structured_output_manager.release(self.scheduler.finish_requests(mine, RequestStatus.FINISHED_ABORTED))
        self._outbox.pop(client_index, None)
        return len(mine)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.requests)

    def _emit(self, client_index: ClientIndex, out: EngineCoreOutput) -> None:
        self._outbox.setdefault(client_index, []).append(out)

    # ---------------------------------------------------------------------- step
    def step(self) -> dict[ClientIndex, EngineCoreOutputs]:
        """Run one step if any request is unfinished; returns every output since the last
        step, one message per front-end that has any (none: an empty dict)."""
        if self.scheduler.has_unfinished_requests():
            t0 = time.perf_counter()
            self._run_step()
            self.step_time_s += time.perf_counter() - t0
            self.num_steps += 1
        if not self._outbox:
            return {}
        outbox, self._outbox = self._outbox, {}
        stats = None if self.config.disable_log_stats else self.scheduler.make_stats()
        now = time.monotonic()
        return {client: EngineCoreOutputs(outputs=outs, scheduler_stats=stats, timestamp=now)
                for client, outs in outbox.items()}

    def _run_step(self) -> None:
        t0 = time.perf_counter()
        som = self.structured_output_manager
        if som.has_pending():
            self._fail_grammars(som.update_grammars())
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            if som.has_pending():  # nothing runs until a grammar is ready: sleep, do not spin
                som.wait_for_grammars(_GRAMMAR_POLL_S)
            return
        self._step_in_flight = scheduler_output
        if self.announce is not None and scheduler_output.scheduled_new_reqs:
            self._announce_started(scheduler_output)
        grammar_failures = som.fill_bitmask(scheduler_output)
        runner_output = self.executor.execute_model(scheduler_output)
        self.forward_time_s += runner_output.forward_time_s
        if self.apply_input is not None:
            self.apply_input()  # see the invariants: aborts that arrived meanwhile win
        if grammar_failures:
            self._fail_grammars(grammar_failures)  # ended before the update, which drops their tokens
        if runner_output.failed_req_ids:
            self._fail_requests(runner_output.failed_req_ids, runner_output.invalid_req_ids)
        for client, outs in self.scheduler.update_from_output(scheduler_output, runner_output).items():
            if client is not None:
                for out in outs:
                    out.request_id = external_id(out.request_id, client)
            self._outbox.setdefault(client, []).extend(outs)
        if self.scheduler.spec is not None:
            # What the whole step cost (proposing, a draft model's passes, verifying, sampling,
            # the update): does speculating pay?
            self.scheduler.spec.observe_step(scheduler_output, time.perf_counter() - t0)
        self._step_in_flight = None

    def _announce_started(self, scheduler_output: SchedulerOutput) -> None:
        """Tell each front-end which of its requests this step runs for the first time on this
        core (a preempted request readmitted was announced already). The output carries the
        request's recorded events (its QUEUED and SCHEDULED stamps, with stats on) or a SCHEDULED
        stamp of its own, so stats see each event once."""
        started: dict[ClientIndex, list[EngineCoreOutput]] = {}
        now = time.monotonic()
        for new in scheduler_output.scheduled_new_reqs:
            request = self.scheduler.requests.get(new.req_id)
            if request is None or request.announced:
                continue
            request.announced = True
            events = request.take_events() or [(int(EngineCoreEventType.SCHEDULED), now)]
            started.setdefault(request.client_index, []).append(EngineCoreOutput(
                external_id(request.request_id, request.client_index), events=events))
        if started:  # a core message like any other: with stats on, it carries the scheduler's
            stats = None if self.config.disable_log_stats else self.scheduler.make_stats()
            self.announce({client: EngineCoreOutputs(outputs=outs, scheduler_stats=stats, timestamp=now)
                           for client, outs in started.items()})

    def failed_step_request_ids(self) -> dict[ClientIndex, list[str]] | None:
        """After `step()` raised: the requests that were in the step that failed, by front-end,
        with that front-end's ids; None when the exception came from outside a step."""
        step = self._step_in_flight
        if step is None:
            return None
        by_client: dict[ClientIndex, list[str]] = {}
        for rid in step.num_scheduled_tokens:
            request = self.scheduler.requests.get(rid)
            # one that ended during the step: its id names its front-end
            client = request.client_index if request is not None else client_of(rid)
            by_client.setdefault(client, []).append(external_id(rid, client))
        return by_client

    def _fail_grammars(self, failures: list[GrammarFailure]) -> None:
        """Requests whose grammar could not be compiled (or matched): each ends alone with an
        ERROR output, INVALID (HTTP 400) when its own spec explains it."""
        for request, error, invalid in failures:
            for r in self.scheduler.finish_requests(request.request_id, RequestStatus.FINISHED_ERROR):
                rid = external_id(r.request_id, r.client_index)
                logger.warning("request %r failed: %s", rid, error)
                kind = ErrorKind.INVALID if invalid else ErrorKind.REQUEST
                self._emit(r.client_index, EngineCoreOutput(rid, finish_reason=FinishReason.ERROR,
                                                            error=f"structured outputs: {error}", error_kind=kind))

    def _fail_requests(self, failures: dict[str, str], invalid: list[str]) -> None:
        """Requests the runner could not sample (it found each culprit by retrying rows apart):
        each ends alone with an ERROR output, and is freed before `update_from_output` runs,
        which then skips it. One aborted meanwhile keeps its ABORT output (its one finish).
        `invalid`: those whose own settings explain it (ErrorKind.INVALID)."""
        for r in self.scheduler.finish_requests(list(failures), RequestStatus.FINISHED_ERROR):
            error = failures[r.request_id]
            rid = external_id(r.request_id, r.client_index)
            logger.error("request %r failed in the step and was ended alone: %s", rid, error)
            kind = ErrorKind.INVALID if r.request_id in invalid else ErrorKind.REQUEST
            self._emit(r.client_index, EngineCoreOutput(rid, finish_reason=FinishReason.ERROR, error=error,
                                                        error_kind=kind))

    # ------------------------------------------------------------------ utility
    def call_utility(self, method: str, args: list[Any]) -> Any:
        fn = self._utilities.get(method)
        if fn is None:
            raise ValueError(f"unknown utility method {method!r}; known: {sorted(self._utilities)}")
        return fn(*args)

    def check_health(self) -> None:
        self.executor.check_health()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
