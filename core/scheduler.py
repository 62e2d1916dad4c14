"""Continuous-batching scheduler with chunked prefill, prefix caching and recompute
preemption (vLLM V1's policy).

Invariants:
- `requests` holds every unfinished request; each is in exactly one of `waiting` (WAITING or
  PREEMPTED, no blocks) and `running` (RUNNING, holds blocks); `len(running) <= max_num_seqs`.
- A running request always has `num_computed_tokens < num_tokens` between steps (its last
  token is computed in the step that samples the next one).
- Per step: sum of scheduled tokens <= max_num_batched_tokens, scheduled requests <= running.
- The runner holds state for a request iff `request.num_synced_tokens > 0`; its id goes in
  `finished_req_ids` once when that state must be dropped (finish, abort, preemption).
- The scheduler trusts its caller: a request it is given passed `check_request` and its id is
  not in `requests` (EngineCore checks both).
- Request events (QUEUED, SCHEDULED, PREEMPTED) are recorded only with `log_stats`.
- Policy (`scheduling_policy`, vLLM's): `waiting` is a RequestQueue (core/request_queue.py)
  that admits FCFS, or by `Request.sort_key` (priority, arrival) under "priority". When blocks
  run out for a running request, the victim is the tail of `running` (FCFS) or the running
  request with the largest sort key (priority); a victim already scheduled this step is taken
  back out of the step (its tokens return to the budget). As in vLLM V1, a waiting request
  never preempts a running one: a high-priority arrival is admitted when blocks allow, and from
  then on the lower-priority running requests are the ones preempted as blocks run out.
- Speculative decoding (speculative_config, core/spec_decode.py): a decoding request may carry
  proposals, scheduled as extra query rows after its last token. After the step its
  num_computed_tokens counts only the rows whose inputs were right (its last token and the
  accepted proposals), the blocks holding only rejected rows go back to the pool, and the
  emitted tokens pass the stop checks one by one. When blocks run out, a request's proposals
  are dropped before anyone is preempted.
- A quarantined request (suspected of a crash) runs only in a step of its own until its first
  token; while any is queued, `Quarantine` (core/quarantine.py) plans the steps, by choosing
  which requests to pass `plan_step` (the scheduler keeps its own lists up to date).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from tidal.core.kv_cache_manager import KVCacheManager
from tidal.core.quarantine import Quarantine
from tidal.core.request import ClientIndex, Request, RequestStatus
from tidal.core.request_queue import RequestQueue, SchedulingPolicy, create_request_queue
from tidal.core.spec_decode import SpecDecoder
from tidal.core.step_plan import StepPlan
from tidal.core.stop_check import check_stop
from tidal.core.structured_output import GrammarConflictError
from tidal.protocol.config import EngineConfig
from tidal.protocol.messages import (
    EngineCoreEventType,
    EngineCoreOutput,
    ErrorKind,
    FinishReason,
    LogprobsArrays,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
)
from tidal.protocol.sizing import max_step_tokens
from tidal.protocol.sliding_window import model_kv_sliding_window
from tidal.protocol.speculative import SpeculativeConfig
from tidal.utils.logging_utils import summarize_exception

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        block_size: int,
        num_kv_blocks: int,
        max_model_len: int,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        log_stats: bool = False,
        policy: SchedulingPolicy | str = SchedulingPolicy.FCFS,
        sliding_window: int | None = None,
        speculative_config: SpeculativeConfig | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1 or max_model_len < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and max_model_len must be >= 1.")
        if num_kv_blocks * block_size < max_model_len:
            raise ValueError(
                f"the KV cache holds {num_kv_blocks * block_size} tokens ({num_kv_blocks} blocks of "
                f"{block_size}), fewer than max_model_len={max_model_len}: raise num_kv_blocks / "
                "kv_cache_memory_bytes or lower max_model_len"
            )
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError(
                f"without chunked prefill max_num_batched_tokens ({max_num_batched_tokens}) must be "
                f">= max_model_len ({max_model_len})."
            )
        self.max_num_seqs: int = max_num_seqs
        self.max_num_batched_tokens: int = max_num_batched_tokens
        self.block_size: int = block_size
        self.max_model_len: int = max_model_len
        self.enable_chunked_prefill: bool = enable_chunked_prefill
        self.log_stats: bool = log_stats
        self.policy: SchedulingPolicy = SchedulingPolicy(policy)
        self.kv_cache_manager: KVCacheManager = KVCacheManager(
            num_kv_blocks, block_size, enable_caching=enable_prefix_caching, sliding_window=sliding_window
        )
        self.requests: dict[str, Request] = {}
        self.waiting: RequestQueue = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Ids whose runner state must be dropped; sent (then cleared) by the next schedule().
        self.finished_req_ids: dict[str, None] = {}  # ordered set
        self.quarantine: Quarantine = Quarantine()  # requests that run alone (core/quarantine.py)
        # Stats (cumulative unless noted).
        self.num_preemptions: int = 0
        self.num_prompt_tokens: int = 0
        self.num_generation_tokens: int = 0
        self.num_batched_tokens: int = 0  # last step
        self.num_scheduled_seqs: int = 0  # last step
        # Speculative decoding's proposer and counters; None: off.
        self.spec: SpecDecoder | None = (None if speculative_config is None
                                         else SpecDecoder(speculative_config, max_model_len))

    @classmethod
    def from_config(cls, cfg: EngineConfig, num_kv_blocks: int, max_model_len: int) -> "Scheduler":
        return cls(
            max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max_step_tokens(cfg.max_num_batched_tokens, max_model_len,
                                                   cfg.enable_chunked_prefill),
            block_size=cfg.block_size,
            num_kv_blocks=num_kv_blocks,
            max_model_len=max_model_len,
            enable_prefix_caching=cfg.enable_prefix_caching,
            enable_chunked_prefill=cfg.enable_chunked_prefill,
            log_stats=not cfg.disable_log_stats,
            policy=cfg.scheduling_policy,
            # Blocks behind the window are freed only when every layer slides (a full-attention
            # layer, e.g. Qwen2's below max_window_layers, needs every position).
            sliding_window=None if cfg.disable_sliding_window else model_kv_sliding_window(cfg.model),
            speculative_config=cfg.speculative_config,
        )

    # ------------------------------------------------------------------ requests in / out

    def add_request(self, request: Request) -> None:
        """Queue a checked request whose id is not in use (see the invariants)."""
        so = request.structured_output_request  # a grammar still compiling holds it back
        waits = so is not None and not so.ready
        request.status = RequestStatus.WAITING_FOR_GRAMMAR if waits else RequestStatus.WAITING
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)
        self.requests[request.request_id] = request
        self.waiting.add_request(request)
        if request.quarantined:
            self.quarantine.add(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort, error): free their blocks, drop them from the
        queues. Unknown (or already finished) ids are ignored. Returns the requests ended."""
        assert RequestStatus.is_finished(status), status
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        ended: list[Request] = []
        waiting: list[Request] = []
        any_running = False
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                any_running = True  # removed from `running` below, in one pass
            else:
                waiting.append(request)
            request.status = status
            self._free_request(request)
            ended.append(request)
        if any_running:
            self.running = [r for r in self.running if not r.is_finished()]
        if waiting:
            self.waiting.remove_requests(waiting)
        return ended

    def _free_request(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        if request.quarantined:
            self.quarantine.discard(request)
        if request.num_synced_tokens > 0:
            self.finished_req_ids[request.request_id] = None
            request.num_synced_tokens = 0

    def _preempt(self, request: Request) -> None:
        """Recompute preemption: drop its KV; it goes back into `waiting` where the policy
        resumes it (FCFS: first; priority: at its sort key)."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        if self.log_stats:
            request.record_event(EngineCoreEventType.PREEMPTED)
        if request.num_synced_tokens > 0:
            self.finished_req_ids[request.request_id] = None
            request.num_synced_tokens = 0
        self.waiting.prepend_request(request)
        self.num_preemptions += 1

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        plan = StepPlan(self.max_num_batched_tokens)
        if self.quarantine:
            self.quarantine.schedule(self, plan)
        else:
            self.plan_step(plan, self.running, self.waiting)
        total = self.max_num_batched_tokens - plan.token_budget
        self.num_batched_tokens = total
        self.num_scheduled_seqs = len(plan.num_scheduled_tokens)
        finished_req_ids = list(self.finished_req_ids)
        self.finished_req_ids = {}
        return SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=list(plan.cached_reqs.values()),
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=total,
            finished_req_ids=finished_req_ids,
            scheduled_spec_decode_tokens=plan.spec_tokens,
        )

    def plan_step(self, plan: StepPlan, running: list[Request], waiting: RequestQueue) -> None:
        """Plan a step from explicit inputs: `running` (self.running, or a list of some of its
        requests in its order) and `waiting` (self.waiting, or a queue of some of its requests).
        A preemption victim comes from `running` only; an admitted request leaves `waiting`
        (and self.waiting) and joins self.running; seats count every running request."""
        self._schedule_running(plan, running)
        if not plan.preempted:  # no WAITING request joins a step that had to preempt
            self._schedule_waiting(plan, waiting)

    def _schedule_running(self, plan: StepPlan, running: list[Request]) -> None:
        """`running` requests, in admission order; preempt (see the invariants) when blocks run out."""
        kv = self.kv_cache_manager
        subset = running is not self.running
        spec = self.spec if self.spec is not None and self.spec.step_enabled(len(self.running)) else None
        req_index = 0
        while req_index < len(running) and plan.token_budget > 0:
            request = running[req_index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, plan.token_budget)
            if num_new_tokens <= 0:  # nothing to compute (runner owes a token): skip it
                req_index += 1
                continue
            proposals: list[int] = []
            if spec is not None and request.num_tokens - request.num_computed_tokens == 1:
                proposals = spec.propose(request, plan.token_budget - 1)
                num_new_tokens += len(proposals)
            while (new_block_ids := kv.allocate_slots(request, num_new_tokens)) is None:
                if proposals:  # fewer rows before anyone is preempted
                    num_new_tokens -= len(proposals)
                    proposals = []
                    continue
                victim_index = self._victim_index(running)
                victim = running.pop(victim_index)
                if subset:
                    self.running.remove(victim)
                if victim_index < req_index:
                    req_index -= 1  # `request` moved up one place
                plan.take_back(victim)
                self._preempt(victim)
                plan.preempted = True
                if victim is request:
                    break
            if new_block_ids is None:
                # `request` preempted itself. FCFS: it was the tail, the loop ends. Priority:
                # those after it outrank it and still get their turn (vLLM stops here instead,
                # leaving them, and maybe the whole step, idle).
                continue
            plan.enter(request, num_new_tokens, new_block_ids, new=False, spec_tokens=proposals)
            req_index += 1

    def _victim_index(self, running: list[Request]) -> int:
        """Index in `running` of the request to preempt: the tail (FCFS), or the largest
        (priority, arrival) sort key (priority: lowest priority, latest arrival)."""
        if self.policy == SchedulingPolicy.FCFS:
            return len(running) - 1
        return max(range(len(running)), key=lambda i: running[i].sort_key)

    def _schedule_waiting(self, plan: StepPlan, waiting: RequestQueue) -> None:
        """WAITING requests in `waiting`'s order, while blocks, budget and seats last."""
        kv = self.kv_cache_manager
        skipped: list[Request] = []  # waiting for their grammar: passed over, put back in order
        admitted: list[Request] | None = None if waiting is self.waiting else []  # a subset's, to drop
        while waiting and plan.token_budget > 0 and len(self.running) < self.max_num_seqs:
            request = waiting.peek_request()
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                skipped.append(waiting.pop_request())
                continue
            hit_block_ids, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = request.num_tokens - num_hit_tokens
            if num_new_tokens > plan.token_budget:
                if not self.enable_chunked_prefill:
                    break
                num_new_tokens = plan.token_budget
            new_block_ids = kv.allocate_slots(request, num_new_tokens, hit_block_ids, num_hit_tokens)
            if new_block_ids is None:
                break
            waiting.pop_request()
            if admitted is not None:
                admitted.append(request)
            self.running.append(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            if self.log_stats:
                request.record_event(EngineCoreEventType.SCHEDULED)
            plan.enter(request, num_new_tokens, kv.get_block_ids(request.request_id), new=True)
        for request in reversed(skipped):
            waiting.prepend_request(request)
        if admitted:
            self.waiting.remove_requests(admitted)

    # ------------------------------------------------------------------ update

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> dict[ClientIndex, list[EngineCoreOutput]]:
        """Apply a step's results; returns the outputs of the requests that advanced, grouped
        by the front-end each goes to (`Request.client_index`)."""
        sampled_by_id = dict(zip(runner_output.req_ids, runner_output.sampled_token_ids))
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        outputs: dict[ClientIndex, list[EngineCoreOutput]] = {}
        any_finished = False

        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # ended (e.g. aborted) after it was scheduled
            try:
                output = self._update_request(request, num_tokens, sampled_by_id.get(request_id) or [],
                                              runner_output, spec_tokens)
            except Exception as e:  # this request's state broke: it fails alone, the step goes on
                output = self._fail_in_update(request, e)
            if output is None:
                continue
            any_finished |= output.finish_reason is not None
            outputs.setdefault(request.client_index, []).append(output)
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _update_request(self, request: Request, num_tokens: int, new_token_ids: list[int],
                        runner_output: ModelRunnerOutput,
                        spec_tokens: dict[str, list[int]] | None = None) -> EngineCoreOutput | None:
        """Apply one request's share of a step; its output, or None when it has nothing new."""
        request_id = request.request_id
        start = request.num_computed_tokens
        proposals = spec_tokens.get(request_id) if spec_tokens else None
        num_rejected = 0
        if proposals:
            # Rows past the last accepted proposal had wrong inputs: their KV is rolled back.
            # (No token at all: the request failed and ends.)
            new_token_ids = new_token_ids[: len(proposals) + 1]
            num_accepted = min(max(len(new_token_ids) - 1, 0), len(proposals))
            num_rejected = len(proposals) - num_accepted
            if new_token_ids and self.spec is not None:
                self.spec.record(len(proposals), num_accepted, request)
        request.num_computed_tokens = start + num_tokens - num_rejected
        if start < request.num_prompt_tokens:
            self.num_prompt_tokens += min(request.num_computed_tokens, request.num_prompt_tokens) - start

        new_logprobs = runner_output.logprobs.get(request_id) if new_token_ids else None
        if new_token_ids:
            num_sampled = len(new_token_ids)
            new_token_ids = self._append_and_check_stop(request, new_token_ids)
            if new_logprobs is not None and len(new_token_ids) < num_sampled:  # a stop inside the run
                n = len(new_token_ids)
                new_logprobs = LogprobsArrays(new_logprobs.token_ids[:n], new_logprobs.logprobs[:n],
                                              new_logprobs.ranks[:n])
        # After the new tokens are in (the blocks they complete are known): positions below
        # min(num_computed_tokens, num_tokens) hold the KV of the request's own tokens.
        self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        new_prompt_logprobs = runner_output.prompt_logprobs.get(request_id)
        if new_prompt_logprobs is not None:
            new_prompt_logprobs = _unsent_prompt_logprobs(request, start, new_prompt_logprobs)
        finish_reason = request.get_finished_reason()
        if finish_reason is not None:
            self._free_request(request)
        elif num_rejected:
            request.num_dropped_blocks += self.kv_cache_manager.drop_tail(request, request.num_tokens)
        if not new_token_ids and new_prompt_logprobs is None:
            return None
        return EngineCoreOutput(
            request_id=request_id,
            new_token_ids=new_token_ids,
            new_logprobs=new_logprobs,
            new_prompt_logprobs=new_prompt_logprobs,
            finish_reason=finish_reason,
            stop_reason=request.stop_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            events=request.take_events(),
        )

    def _fail_in_update(self, request: Request, e: Exception) -> EngineCoreOutput:
        """End a request whose update raised with an ERROR output; its state may be half
        updated, so none of it is reported, and its blocks are freed (not cached further)."""
        error = f"building this request's output failed: {summarize_exception(e)}"
        logger.error("request %r failed in the step and was ended alone: %s", request.request_id, error)
        request.status = RequestStatus.FINISHED_ERROR
        if request.request_id in self.requests:  # not freed before it raised
            self._free_request(request)
        kind = ErrorKind.INVALID if isinstance(e, GrammarConflictError) else ErrorKind.REQUEST
        return EngineCoreOutput(request.request_id, finish_reason=FinishReason.ERROR, error=error, error_kind=kind)

    def _append_and_check_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        """Append sampled tokens one by one until a stop; returns those kept."""
        for i, token_id in enumerate(token_ids):
            request.append_output_token_ids(token_id)
            self.num_generation_tokens += 1
            if check_stop(request, token_id, self.max_model_len):
                return token_ids[: i + 1]
        return token_ids

    # ------------------------------------------------------------------ misc

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        kv = self.kv_cache_manager
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            num_free_blocks=kv.num_free_blocks,
            num_total_blocks=kv.num_blocks,
            num_batched_tokens=self.num_batched_tokens,
            num_scheduled_seqs=self.num_scheduled_seqs,
            **({} if self.spec is None else dict(
                spec_decode_num_drafts=self.spec.num_drafts,
                spec_decode_num_draft_tokens=self.spec.num_draft_tokens,
                spec_decode_num_accepted_tokens=self.spec.num_accepted_tokens,
                spec_decode_num_accepted_tokens_per_pos=list(self.spec.num_accepted_tokens_per_pos))),
        )


def _unsent_prompt_logprobs(request: Request, start: int, arrays: LogprobsArrays) -> LogprobsArrays | None:
    """The rows of `arrays` not sent before (row i is the logprob of prompt token start + i + 1):
    a request preempted mid-prefill recomputes rows that already went out. None: all were sent."""
    skip = max(0, request.num_prompt_logprobs_sent - start)
    if skip >= len(arrays.ranks):
        return None
    if skip:
        arrays = LogprobsArrays(arrays.token_ids[skip:], arrays.logprobs[skip:], arrays.ranks[skip:])
    request.num_prompt_logprobs_sent = start + skip + len(arrays.ranks)
    return arrays
