"""Front-end output processing (vLLM V1's output_processor.py).

Per engine-core output: the request's detokenizer releases text and finds stop strings, its
logprobs accumulator collects rows, and its state builds the user's `CompletionOutput` for its
output kind; the `RequestOutput` goes in the request's queue (`AsyncLLM`) or is returned
(`LLM`). `add_request` fans n > 1 requests out to children, whose outputs are aggregated here.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Iterable

from tidal.frontend.detokenizer import TokenTexts
from tidal.frontend.metrics_stats import IterationStats
from tidal.frontend.output_collector import RequestOutputCollector
from tidal.frontend.parallel_sampling import ParentRequest
from tidal.frontend.recovery import give_up_output, triage
from tidal.frontend.request_state import STATE_CLASS, RequestState, Step
from tidal.protocol.errors import EngineGenerateError, EngineOverloadedError, InvalidRequestError
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, ErrorKind, FinishReason
from tidal.protocol.outputs import CompletionOutput, RequestOutput, RequestStateStats, append_delta

logger = logging.getLogger(__name__)

_MAX_AWAITING = 4096
# Refused at admission (queue full, core draining) or as invalid: classes of their own, so
# callers (and the server's 503 / 400) can tell "retry later" and "fix the request" from a
# request that failed.
_ERROR_CLASS: dict[ErrorKind, type[EngineGenerateError]] = {
    ErrorKind.OVERLOADED: EngineOverloadedError, ErrorKind.INVALID: InvalidRequestError}


@dataclass
class OutputProcessorOutput:
    # Outputs of requests without a queue (LLM); an EngineGenerateError there must be raised.
    request_outputs: list[RequestOutput | Exception] = field(default_factory=list)
    # Requests the front-end finished (stop strings) that the core must abort.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Turns `EngineCoreOutput`s into `RequestOutput`s; owns every request's front-end state."""

    def __init__(self, tokenizer: Any | None, log_stats: bool = False, stream_interval: int = 1) -> None:
        self.tokenizer = tokenizer
        self.log_stats = log_stats  # fill RequestOutput.metrics
        self.stream_interval = stream_interval  # EngineConfig.stream_interval (vLLM's)
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # Ids the front-end dropped before the core's final output for them came: that output
        # (and anything before it) belongs to the old request even if the id was reused since.
        self._awaiting_final: dict[str, int] = {}
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None
        # pause_generation(mode="keep"): requests whose core run was aborted while their state
        # here stays open. `_parking`: the core's one finished output for the old run is still
        # to come (the outputs before it are processed as usual); `_parked`: it came (or the
        # core was lost), nothing of it runs anywhere until `unpark_requests`. Both are subsets
        # of request_states (`_drop` keeps them so).
        self._parking: set[str] = set()
        self._parked: set[str] = set()

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    queue: RequestOutputCollector | None = None) -> list[EngineCoreRequest]:
        """Track a processed request (its id is not running: the caller made it unique).
        Returns what to send to the core: the request, or for n > 1 its n children, whose
        outputs come back under the request's id. All or nothing: every state is built before
        any is registered, so a request that fails here leaves no state behind."""
        parent, requests = None, [request]
        if request.sampling_params.n > 1:
            parent = ParentRequest(request.request_id, request.sampling_params)
            requests = parent.make_children(request)
        states = [STATE_CLASS[req.sampling_params.output_kind](
            req, prompt, parent, index, queue, self.tokenizer, self._token_texts, self.log_stats)
            for index, req in enumerate(requests)]
        if parent is not None:
            self.parent_requests[parent.request_id] = parent
        for state in states:
            self.request_states[state.request_id] = state
        return requests

    def remove_request(self, request_id: str) -> None:
        """Forget a request (a parent id: its children) that was never sent to the core."""
        for state in self._expand(request_id):
            self._drop(state)
        self.parent_requests.pop(request_id, None)

    def _step(self, iteration_stats: IterationStats | None, timestamp: float | None) -> Step | None:
        if not self.log_stats:
            return None
        return Step(IterationStats() if iteration_stats is None else iteration_stats,
                     time.monotonic() if timestamp is None else timestamp)

    def process_outputs(self, outputs: list[EngineCoreOutput], engine_core_timestamp: float | None = None,
                        iteration_stats: IterationStats | None = None) -> OutputProcessorOutput:
        """`engine_core_timestamp` (the message's) and `iteration_stats` (one per core message,
        filled here, recorded by the caller) matter only with stats on."""
        result = OutputProcessorOutput()
        step = self._step(iteration_stats, engine_core_timestamp)
        request_outputs, reqs_to_abort = result.request_outputs, result.reqs_to_abort
        states, awaiting, parking = self.request_states, self._awaiting_final, self._parking
        for out in outputs:
            req_id = out.request_id
            if awaiting and req_id in awaiting:
                if out.finish_reason is not None:  # the old request's last word
                    if (left := awaiting.pop(req_id) - 1) > 0:
                        awaiting[req_id] = left
                continue
            if parking and req_id in parking and out.finish_reason is not None:
                parking.discard(req_id)
                if out.finish_reason == FinishReason.ABORT:  # the keep-pause's own abort: parked
                    self._parked.add(req_id)
                    continue
                # else it finished on its own meanwhile (length, stop, error): as usual below
            state = states.get(req_id)
            if state is None:
                continue  # aborted, or unknown
            try:
                self._process_one(state, out, step, request_outputs, reqs_to_abort)
            except Exception as e:
                self._fail_processing(state, out, e, request_outputs, reqs_to_abort)
        return result

    def _process_one(self, state: RequestState, out: EngineCoreOutput, step: Step | None,
                     request_outputs: list[RequestOutput | Exception], reqs_to_abort: list[str]) -> None:
        if out.finish_reason is not None and out.finish_reason == FinishReason.ERROR:
            self._fail(state, out.error or f"request {state.external_req_id} failed", step,
                       request_outputs, _ERROR_CLASS.get(out.error_kind, EngineGenerateError))
            return
        completion = state.update(out, step)
        if completion is None:
            return
        if self.stream_interval > 1 and (completion := self._paced(state, completion)) is None:
            return  # held back: stream_interval
        self._emit(state, completion, request_outputs)
        if completion.finish_reason is not None:
            self._finished(state, completion.finish_reason, step)
            if out.finish_reason is None:  # a stop string: the core has not finished it
                reqs_to_abort.append(self._abort(state))
            else:
                self._drop(state)

    def _fail_processing(self, state: RequestState, out: EngineCoreOutput, e: Exception,
                         request_outputs: list[RequestOutput | Exception], reqs_to_abort: list[str]) -> None:
        """One request's output could not be processed (say, a Python tokenizer that cannot
        decode an id of the model's padded vocabulary): that request ends with the error (and
        is aborted in the core if it runs there), the rest of the message and every other
        stream go on. Its stats are left out: they may be what failed."""
        logger.error("request %s: processing its output failed", state.external_req_id, exc_info=e)
        if self.request_states.get(state.request_id) is not state:
            return  # it was already ended before the failure
        if out.finish_reason is None:  # still running in the core
            reqs_to_abort.append(self._abort(state))
        self._fail(state, f"processing this request's output failed: {type(e).__name__}: {e}", None,
                   request_outputs)

    def _fail(self, state: RequestState, message: str, step: Step | None,
              request_outputs: list[RequestOutput | Exception],
              error_class: type[EngineGenerateError] = EngineGenerateError) -> None:
        self._finished(state, "error", step)
        self._drop(state)
        exc = error_class(message)
        exc.request_id = state.external_req_id  # type: ignore[attr-defined]
        state.queue.put(exc) if state.queue is not None else request_outputs.append(exc)

    def resume_after_crash(self, failed_step_request_ids: list[str] | None = None,
                           only: Collection[str] | None = None
                           ) -> tuple[list[EngineCoreRequest], list[EngineCoreOutput]]:
        """The engine core died and a new one runs: the requests to send it, each resuming
        where its stream is (the tokens generated so far go as `resumed_output_token_ids`, the
        prompt-logprob rows received are not sent again), and an ERROR output for each request
        given up; which is which is `recovery.triage`'s blame rule. What the lost core had sent
        after the last message read here is generated again, identically (sampling is a
        function of seed and position). `only`: the requests the lost core held (data
        parallelism: one of several cores died); None: every open request."""
        lost = (lambda rid: True) if only is None else set(only).__contains__
        # The old core's final outputs will never come.
        for rid in [rid for rid in self._awaiting_final if lost(rid)]:
            del self._awaiting_final[rid]
        # A parking request's run ended with the core: parked. Parked ones stay out of the new
        # core until unpark_requests (and out of the blame: they were not running).
        ended = {rid for rid in self._parking if lost(rid)}
        self._parked.update(ended)
        self._parking.difference_update(ended)
        states, parked = self.request_states, self._parked
        plan = triage(((st.resume, len(st.generated)) for rid, st in states.items()
                       if rid not in parked and lost(rid)), failed_step_request_ids)
        resend: list[EngineCoreRequest] = []
        for record in plan.resend:
            state = states[record.request_id]
            state.resume = record
            resend.append(record.resubmission(state.generated))
        return resend, [give_up_output(record) for record in plan.give_up]

    # ------------------------------------------------------- pause(mode="keep")
    def park_requests(self) -> list[str]:
        """pause_generation(mode="keep"): every open request not parked yet is to leave the core
        while its stream stays open; returns their ids, for the core to abort. Each is parked
        once the core's one finished output for its run came (`has_parking` is False then):
        from there on no token of it is computed anywhere."""
        ids = [rid for rid in self.request_states if rid not in self._parked and rid not in self._parking]
        self._parking.update(ids)
        return ids

    def has_parking(self) -> bool:
        """Some request frozen by pause(mode="keep") still has its run in the core (the core's
        finished output for it has not come yet)."""
        return bool(self._parking)

    def num_parked(self) -> int:
        return len(self._parked) + len(self._parking)

    def has_unparked_requests(self) -> bool:
        """Requests that run (or are queued) in the core: neither parked nor parking."""
        return len(self.request_states) > len(self._parked) + len(self._parking)

    def unpark_requests(self) -> list[EngineCoreRequest]:
        """resume_generation(): the parked requests, each as the request to send the core to
        resume where its stream is (prompt + the tokens so far, as after a core restart; by the
        determinism rule the stream goes on unchanged). Call once `has_parking()` is False."""
        assert not self._parking, "a parked request's run in the core has not ended yet"
        states, resend = self.request_states, []
        for rid in [rid for rid in states if rid in self._parked]:  # arrival order
            state = states[rid]
            record, n = state.resume, len(state.generated)
            if n > record.progress_mark:  # progress since it was last sent: cleared (triage's rule)
                record = dataclasses.replace(record, progress_mark=n, suspect_streak=0, solo_crashes=0,
                                             quarantined=False, started=False)
            else:
                record = dataclasses.replace(record, started=False)
            state.resume = record
            resend.append(record.resubmission(state.generated))
        self._parked.clear()
        return resend

    def fail_request(self, request_id: str, message: str) -> None:
        """End one open request (not running in the core) with EngineGenerateError(message)."""
        state = self.request_states.get(request_id)
        if state is not None:
            self._fail(state, message, None, [])

    def _paced(self, state: RequestState, completion: CompletionOutput) -> CompletionOutput | None:
        """vLLM's stream_interval: the completion to send now, or None to hold it back. A stream
        sends its first output, then one whenever `stream_interval` tokens came since the last,
        and its last; a held DELTA completion joins the next one sent (text, ids, logprobs), a
        held CUMULATIVE one is superseded by it. FINAL_ONLY states make only the last."""
        if completion.finish_reason is None and state.sent_tokens and \
                len(state.generated) - state.sent_tokens < self.stream_interval:
            if state.output_kind_is_delta:  # (held: this state's own, never sent, so it may grow)
                if state.held is None:
                    state.held = completion
                else:
                    append_delta(state.held, completion)
            return None
        return self._with_held(state, completion)

    @staticmethod
    def _with_held(state: RequestState, completion: CompletionOutput) -> CompletionOutput:
        """`completion` to send, with what stream_interval held back before it."""
        held, state.held, state.sent_tokens = state.held, None, len(state.generated)
        if held is None:
            return completion
        append_delta(held, completion)
        return held

    def _emit(self, state: RequestState, completion: CompletionOutput,
              request_outputs: list[RequestOutput | Exception]) -> None:
        parent = state.parent
        if parent is None:
            outs, finished = [completion], completion.finish_reason is not None
        else:
            outs, finished = parent.get_outputs(state.request_id, completion)
            if not outs:
                return
        plp = None if state.logprobs is None else state.logprobs.prompt()
        # A copy: an output is a snapshot, and the state's stats go on changing. (The
        # constructor over the instance's dict, 0.7 us: copy.copy's generic reduce/reconstruct
        # path took 2.4 us, ~8% of a streaming server's front-end CPU per chunk.)
        stats = state.stats
        metrics = None if stats is None else RequestStateStats(**stats.__dict__)
        output = RequestOutput(state.external_req_id, state.prompt, state.prompt_token_ids,
                               plp, outs, finished, state.num_cached_tokens, metrics)
        state.queue.put(output) if state.queue is not None else request_outputs.append(output)

    @staticmethod
    def _finished(state: RequestState, reason: str, step: Step | None) -> None:
        if step is None or state.stats is None:
            return
        parent = state.parent
        if parent is None:
            step.stats.update_from_finished_request(reason, len(state.prompt_token_ids), state.max_tokens,
                                                    state.stats, state.num_cached_tokens)
            return
        last = parent.finish_stats(state.stats.num_generation_tokens)
        step.stats.update_from_finished_request(
            reason, len(state.prompt_token_ids), state.max_tokens, state.stats, state.num_cached_tokens,
            n_param=parent.sampling_params.n, group_finished=last,
            group_max_generation_tokens=parent.max_generation_tokens)

    def _drop(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
        if self._parking or self._parked:
            self._parking.discard(state.request_id)
            self._parked.discard(state.request_id)
        parent = state.parent
        if parent is not None:
            parent.child_requests.discard(state.request_id)
            if not parent.child_requests:
                self.parent_requests.pop(parent.request_id, None)

    def _expect_final(self, req_id: str) -> None:
        awaiting = self._awaiting_final
        awaiting[req_id] = awaiting.get(req_id, 0) + 1
        if len(awaiting) > _MAX_AWAITING:  # bound it, should the core never answer some
            del awaiting[next(iter(awaiting))]

    def _expand(self, request_ids: Iterable[str]) -> list[RequestState]:
        request_ids = [request_ids] if isinstance(request_ids, str) else request_ids
        found: list[RequestState] = []
        for rid in request_ids:
            state = self.request_states.get(rid)
            if state is not None:
                found.append(state)
            elif (parent := self.parent_requests.get(rid)) is not None:
                found.extend(sorted((self.request_states[c] for c in parent.child_requests
                                     if c in self.request_states), key=lambda st: st.index))
        return found

    def _abort(self, state: RequestState) -> str:
        """Drop a request the core has not finished; returns its id, for the core to abort.
        A parked one is not in the core: no final output of it will come."""
        in_core = state.request_id not in self._parked
        self._drop(state)
        if in_core:
            self._expect_final(state.request_id)
        return state.request_id

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Drop the state of these requests (a parent id means its children), emitting nothing.
        Returns the ids the core must abort."""
        return [self._abort(state) for state in self._expand(request_ids)]

    def finish_request_aborted(self, request_ids: Iterable[str],
                               iteration_stats: IterationStats | None = None) -> OutputProcessorOutput:
        """User abort(): end each stream normally, with finish_reason "abort" and the partial
        output (into its queue, else in request_outputs); reqs_to_abort lists the core's ids.
        The core's own ABORT output for them, if it comes, is then ignored."""
        result = OutputProcessorOutput()
        step = self._step(iteration_stats, None)
        for state in self._expand(request_ids):
            completion = state.update(EngineCoreOutput(state.request_id, finish_reason=FinishReason.ABORT), step)
            if completion is not None:  # a finish: never held back, and what was held joins it
                self._emit(state, self._with_held(state, completion), result.request_outputs)
            self._finished(state, "abort", step)
            result.reqs_to_abort.append(self._abort(state))
        return result

    def propagate_error(self, exc: BaseException) -> None:
        """The engine died: every open stream gets `exc`."""
        states = self.request_states.values()
        for queue in {id(st.queue): st.queue for st in states if st.queue is not None}.values():
            queue.put(exc)

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def get_num_unfinished_requests(self) -> int:
        return len(self.request_states)
