"""Front-end output processing (vLLM V1's output_processor.py and parallel_sampling.py).

Per engine-core output: detokenize, check stop strings, accumulate logprobs, and build the
user's `RequestOutput` for the request's output kind; then put it in the request's queue
(`AsyncLLM`) or return it (`LLM`). Fans n > 1 requests out to children and aggregates them.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from tidal.frontend.detokenizer import IncrementalDetokenizer, TokenTexts, logprobs_to_dicts
from tidal.protocol.errors import EngineGenerateError
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsArrays
from tidal.protocol.outputs import CompletionOutput, Logprob, RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams

_DELTA = RequestOutputKind.DELTA
_FINAL_ONLY = RequestOutputKind.FINAL_ONLY
_STOP = FinishReason.STOP
_FINISH_STR = {r: str(r) for r in FinishReason}
_MAX_AWAITING = 4096
TokenText = Callable[[int], str]


class RequestOutputCollector:
    """One request's queue for AsyncLLM. Holds at most one item: when the consumer lags, DELTA
    outputs merge into the pending one (nothing is lost), CUMULATIVE/FINAL_ONLY outputs replace
    it (per completion index, so n > 1 children never overwrite each other); an exception wins."""

    __slots__ = ("aggregate", "output", "_waiter")

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == _DELTA
        self.output: RequestOutput | BaseException | None = None
        # The consumer's wake-up: a bare Future made in the running loop by get() (an
        # asyncio.Event's semantics, with less work per wake-up on this hot path).
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Non-blocking; call it from the event loop's thread."""
        current = self.output
        if current is None or isinstance(item, BaseException):
            self.output = item
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif isinstance(current, RequestOutput):
            _merge_request_output(current, item, self.aggregate)

    async def get(self) -> RequestOutput:
        """The pending output (raising a pending exception), waiting for one if need be."""
        while self.output is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self.get_nowait()  # type: ignore[return-value]

    def get_nowait(self) -> RequestOutput | None:
        output, self.output = self.output, None
        if isinstance(output, BaseException):
            raise output
        return output


def _merge_request_output(current: RequestOutput, new: RequestOutput, aggregate: bool) -> None:
    current.finished = new.finished
    current.num_cached_tokens = new.num_cached_tokens
    if new.prompt_logprobs is not None:
        current.prompt_logprobs = (current.prompt_logprobs + new.prompt_logprobs if aggregate
                                   and current.prompt_logprobs is not None else new.prompt_logprobs)
    outputs = current.outputs
    for nxt in new.outputs:
        for i, cur in enumerate(outputs):
            if cur.index == nxt.index:
                if aggregate:  # copies, never extending lists another output may share
                    cur.text += nxt.text
                    cur.token_ids = cur.token_ids + nxt.token_ids
                    if nxt.logprobs:
                        cur.logprobs = (cur.logprobs or []) + nxt.logprobs
                    cur.cumulative_logprob = nxt.cumulative_logprob
                    cur.finish_reason = nxt.finish_reason
                    cur.stop_reason = nxt.stop_reason
                else:
                    outputs[i] = nxt
                break
        else:
            outputs.append(nxt)
            outputs.sort(key=lambda c: c.index)


class ParentRequest:
    """An n > 1 request fanned out to n children `f"{index}_{parent_id}"`, child i seeded
    `seed + i`; aggregates their CompletionOutputs under the parent's id."""

    __slots__ = ("request_id", "sampling_params", "n", "child_requests", "output_aggregator")

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id, self.sampling_params, self.n = request_id, sampling_params, sampling_params.n
        self.child_requests: set[str] = set()  # children not finished yet
        self.output_aggregator: list[CompletionOutput | None] = [None] * self.n

    def get_child_info(self, index: int) -> tuple[str, SamplingParams]:
        seed = self.sampling_params.seed
        params = self.sampling_params.clone(n=1, seed=None if seed is None else seed + index)
        return f"{index}_{self.request_id}", params

    def make_child_request(self, request: EngineCoreRequest, index: int) -> EngineCoreRequest:
        """The child `EngineCoreRequest` of the parent's (processed) request."""
        child_id, params = self.get_child_info(index)
        return EngineCoreRequest(child_id, request.prompt_token_ids, params,
                                 request.eos_token_id, request.arrival_time)

    def get_outputs(self, child_request_id: str,
                    completion: CompletionOutput) -> tuple[list[CompletionOutput], bool]:
        """(outputs to emit now, whether the parent is finished)."""
        if completion.finish_reason is not None:
            self.child_requests.discard(child_request_id)
        finished = not self.child_requests
        if self.sampling_params.output_kind != _FINAL_ONLY:
            return [completion], finished
        self.output_aggregator[completion.index] = completion
        if not finished:
            return [], False
        return [c for c in self.output_aggregator if c is not None], True


class RequestState:
    """Front-end state of one (child) request."""

    __slots__ = (
        "request_id", "external_req_id", "parent", "index", "queue", "prompt", "prompt_token_ids",
        "output_kind", "detokenizer", "stop", "include_stop", "hold", "min_tokens", "pending",
        "text", "text_parts", "token_ids", "num_tokens", "logprobs", "lp_parts", "lp_sent",
        "cumulative_logprob", "prompt_logprobs", "plp_sent", "num_cached_tokens", "token_text",
    )

    def __init__(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None,
                 index: int, queue: RequestOutputCollector | None, tokenizer: Any | None,
                 token_text: TokenText | None) -> None:
        params, self.request_id = request.sampling_params, request.request_id
        self.external_req_id = parent.request_id if parent is not None else request.request_id
        self.parent, self.index, self.queue = parent, index, queue
        self.prompt, self.prompt_token_ids = prompt, request.prompt_token_ids
        self.output_kind = params.output_kind
        self.detokenizer = IncrementalDetokenizer.from_request(tokenizer, request)
        self.stop: tuple[str, ...] = tuple(params.stop or ()) if tokenizer is not None else ()
        self.include_stop = params.include_stop_str_in_output
        # Characters held back while streaming: they could be the start of a stop string (also
        # with include_stop_str_in_output: the held text is the stop search's window).
        self.hold = max(map(len, self.stop)) - 1 if self.stop else 0
        self.min_tokens = params.min_tokens
        self.pending = ""  # decoded text not released yet (stop-string hold-back)
        self.text = ""  # released text (CUMULATIVE)
        self.text_parts: list[str] = []  # released text (FINAL_ONLY)
        self.token_ids: list[int] = []  # all output ids (not kept for DELTA)
        self.num_tokens = 0
        want_lp = params.logprobs is not None
        self.logprobs: list[dict[int, Logprob]] | None = [] if want_lp else None
        self.lp_parts: list[LogprobsArrays] = []  # not converted yet
        self.cumulative_logprob: float | None = 0.0 if want_lp else None
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.lp_sent = self.plp_sent = self.num_cached_tokens = 0
        self.token_text = token_text if params.detokenize else None

    def update(self, out: EngineCoreOutput) -> tuple[CompletionOutput | None, bool]:
        """Apply one core output. Returns (completion to emit or None, stopped by a stop string)."""
        new_ids, finish, stop_reason = out.new_token_ids, out.finish_reason, out.stop_reason
        n_new = len(new_ids)
        self.num_tokens += n_new
        kind = self.output_kind
        if kind != _DELTA and n_new:
            self.token_ids.extend(new_ids)
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        # 1) Text. A stop token's own text is left out unless include_stop_str_in_output.
        detok = self.detokenizer
        if finish is not None and finish == _STOP and n_new and not self.include_stop:
            text = detok.update(new_ids[:-1]) if n_new > 1 else ""
        else:
            text = detok.update(new_ids)
        if finish is not None:
            text += detok.flush()
        stopped = False
        if self.stop:
            pending = self.pending + text if self.pending else text
            if text and self.num_tokens > self.min_tokens:
                # The earliest stop string that ends inside the new text.
                new_start = len(pending) - len(text)
                start = new_start - self.hold if new_start > self.hold else 0
                best, best_s = -1, ""
                for stop_s in self.stop:
                    i = pending.find(stop_s, start)
                    while i != -1 and i + len(stop_s) <= new_start:  # older, unchecked text
                        i = pending.find(stop_s, i + 1)
                    if i != -1 and (best == -1 or i < best):
                        best, best_s = i, stop_s
                if best != -1:
                    pending = pending[:best + len(best_s) if self.include_stop else best]
                    finish, stop_reason, stopped = _STOP, best_s, True
            cut = len(pending) - self.hold if finish is None else len(pending)
            cut = max(cut, 0)
            text, self.pending = pending[:cut], pending[cut:]
        # 2) Logprobs arrive as arrays; converted only when an output needs them.
        if out.new_logprobs is not None and self.logprobs is not None:
            self.lp_parts.append(out.new_logprobs)
        if out.new_prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs.extend(logprobs_to_dicts(out.new_prompt_logprobs, self.token_text)[0])
        # 3) The completion for this output kind.
        if finish is None:
            if kind == _FINAL_ONLY:
                if text:
                    self.text_parts.append(text)
                return None, False
            if not n_new:
                return None, False  # e.g. a prompt-logprobs chunk of a chunked prefill
        logprobs = None if self.logprobs is None else self._take_logprobs(kind)
        finish_str = None if finish is None else _FINISH_STR[finish]
        stop_reason = None if finish is None else stop_reason
        if kind == _DELTA:
            return CompletionOutput(self.index, text, new_ids, self.cumulative_logprob, logprobs,
                                    finish_str, stop_reason), stopped
        if kind == _FINAL_ONLY:
            self.text_parts.append(text)
            return CompletionOutput(self.index, "".join(self.text_parts), self.token_ids,
                                    self.cumulative_logprob, logprobs, finish_str, stop_reason), stopped
        if text:
            self.text += text
        token_ids = self.token_ids if finish is not None else self.token_ids[:]
        return CompletionOutput(self.index, self.text, token_ids, self.cumulative_logprob,
                                logprobs, finish_str, stop_reason), stopped

    def _take_logprobs(self, kind: RequestOutputKind) -> list[dict[int, Logprob]] | None:
        all_rows = self.logprobs
        assert all_rows is not None
        if self.lp_parts:
            for arrays in self.lp_parts:
                rows, total = logprobs_to_dicts(arrays, self.token_text)
                all_rows.extend(rows)
                self.cumulative_logprob += total  # type: ignore[operator]
            self.lp_parts.clear()
        if kind == _DELTA:
            rows, self.lp_sent = all_rows[self.lp_sent:], len(all_rows)
            return rows
        return all_rows if kind == _FINAL_ONLY else all_rows[:]

    def take_prompt_logprobs(self) -> list[dict[int, Logprob] | None] | None:
        plp = self.prompt_logprobs
        if plp is None or self.output_kind != _DELTA:
            return plp
        rows, self.plp_sent = plp[self.plp_sent:], len(plp)
        return rows or None


@dataclass
class OutputProcessorOutput:
    # Outputs of requests without a queue (LLM); an EngineGenerateError there must be raised.
    request_outputs: list[RequestOutput | Exception] = field(default_factory=list)
    # Requests the front-end finished (stop strings) that the core must abort.
    reqs_to_abort: list[str] = field(default_factory=list)


class OutputProcessor:
    """Turns `EngineCoreOutput`s into `RequestOutput`s; owns every request's front-end state."""

    def __init__(self, tokenizer: Any | None) -> None:
        self.tokenizer = tokenizer
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        # Ids the front-end dropped before the core's final output for them came: that output
        # (and anything before it) belongs to the old request even if the id was reused since.
        self._awaiting_final: dict[str, int] = {}
        self._token_texts = TokenTexts(tokenizer) if tokenizer is not None else None

    def add_request(self, request: EngineCoreRequest, prompt: str | None,
                    parent: ParentRequest | None = None, index: int = 0,
                    queue: RequestOutputCollector | None = None) -> None:
        request_id = request.request_id
        if request_id in self.request_states or (parent is None and request_id in self.parent_requests):
            raise ValueError(f"request id {request_id!r} is already running")
        if parent is not None:
            known = self.parent_requests.setdefault(parent.request_id, parent)
            if known is not parent or parent.request_id in self.request_states:
                raise ValueError(f"request id {parent.request_id!r} is already running")
            parent.child_requests.add(request_id)
        token_text = self._token_texts.get if self._token_texts is not None else None
        self.request_states[request_id] = RequestState(
            request, prompt, parent, index, queue, self.tokenizer, token_text)

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> OutputProcessorOutput:
        result = OutputProcessorOutput()
        request_outputs, reqs_to_abort = result.request_outputs, result.reqs_to_abort
        states, awaiting = self.request_states, self._awaiting_final
        for out in outputs:
            req_id = out.request_id
            if awaiting and req_id in awaiting:
                if out.finish_reason is not None:  # the old request's last word
                    if (left := awaiting.pop(req_id) - 1) > 0:
                        awaiting[req_id] = left
                continue
            state = states.get(req_id)
            if state is None:
                continue  # aborted, or unknown
            if out.finish_reason is not None and out.finish_reason == FinishReason.ERROR:
                self._drop(state)
                exc = EngineGenerateError(out.error or f"request {state.external_req_id} failed")
                exc.request_id = state.external_req_id  # type: ignore[attr-defined]
                state.queue.put(exc) if state.queue is not None else request_outputs.append(exc)
                continue
            completion, stopped = state.update(out)
            if completion is None:
                continue
            self._emit(state, completion, request_outputs)
            if completion.finish_reason is not None:
                self._drop(state)
                if stopped and out.finish_reason is None:
                    reqs_to_abort.append(req_id)
                    self._expect_final(req_id)
        return result

    def _emit(self, state: RequestState, completion: CompletionOutput,
              request_outputs: list[RequestOutput | Exception]) -> None:
        parent = state.parent
        if parent is None:
            outs, finished = [completion], completion.finish_reason is not None
        else:
            outs, finished = parent.get_outputs(state.request_id, completion)
            if not outs:
                return
        plp = None if state.prompt_logprobs is None else state.take_prompt_logprobs()
        output = RequestOutput(state.external_req_id, state.prompt, state.prompt_token_ids,
                               plp, outs, finished, state.num_cached_tokens)
        state.queue.put(output) if state.queue is not None else request_outputs.append(output)

    def _drop(self, state: RequestState) -> None:
        self.request_states.pop(state.request_id, None)
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

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Drop the state of these requests (a parent id means its children), emitting nothing.
        Returns the ids the core must abort."""
        to_abort: list[str] = []
        for state in self._expand(request_ids):
            self._drop(state)
            self._expect_final(state.request_id)
            to_abort.append(state.request_id)
        return to_abort

    def finish_request_aborted(self, request_ids: Iterable[str]) -> OutputProcessorOutput:
        """User abort(): end each stream normally, with finish_reason "abort" and the partial
        output (into its queue, else in request_outputs); reqs_to_abort lists the core's ids.
        The core's own ABORT output for them, if it comes, is then ignored."""
        result = OutputProcessorOutput()
        for state in self._expand(request_ids):
            completion, _ = state.update(EngineCoreOutput(state.request_id, finish_reason=FinishReason.ABORT))
            if completion is not None:
                self._emit(state, completion, result.request_outputs)
            self._drop(state)
            self._expect_final(state.request_id)
            result.reqs_to_abort.append(state.request_id)
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
