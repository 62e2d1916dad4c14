"""One request's front-end state while its outputs come in (vLLM V1's RequestState in
output_processor.py): its detokenizer (text and stop strings), its logprobs and stats, and a
subclass per output kind that builds the user's `CompletionOutput`s. OutputProcessor owns them.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from tidal.frontend.detokenizer import IncrementalDetokenizer, LogprobsAccumulator, TokenTexts
from tidal.frontend.metrics_stats import IterationStats
from tidal.frontend.output_collector import RequestOutputCollector
from tidal.frontend.parallel_sampling import ParentRequest
from tidal.frontend.recovery import ResumeRecord
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsArrays
from tidal.protocol.outputs import CompletionOutput, RequestStateStats
from tidal.protocol.sampling_params import RequestOutputKind

_FINISH_STR = {r: str(r) for r in FinishReason}
_STOP_STR = str(FinishReason.STOP)
_NO_LOGPROBS: tuple[None, None] = (None, None)


def _first_tokens(out: EngineCoreOutput, n: int) -> EngineCoreOutput:
    """`out` with its first `n` new tokens only (and their logprobs)."""
    lp = out.new_logprobs
    if lp is not None:
        lp = LogprobsArrays(lp.token_ids[:n], lp.logprobs[:n], lp.ranks[:n])
    return msgspec.structs.replace(out, new_token_ids=out.new_token_ids[:n], new_logprobs=lp)


class RequestState:
    """Front-end state of one (child) request: its detokenizer (text and stop strings), its
    logprobs, its stats; a subclass per output kind builds the completions (`_completion`)."""

    _keeps_token_ids = True  # `_completion` appends every output id to token_ids
    output_kind_is_delta = False  # outputs carry only what is new (their held ones must join)
    __slots__ = ("request_id", "external_req_id", "parent", "index", "queue", "prompt",
                 "prompt_token_ids", "detokenizer", "logprobs", "num_cached_tokens", "stats", "max_tokens",
                 "text", "text_parts", "token_ids", "generated", "resume", "sent_tokens", "held")

    def __init__(self, request: EngineCoreRequest, prompt: str | None, parent: ParentRequest | None,
                 index: int, queue: RequestOutputCollector | None, tokenizer: Any | None,
                 token_texts: TokenTexts | None, log_stats: bool) -> None:
        params, self.request_id = request.sampling_params, request.request_id
        self.external_req_id = parent.request_id if parent is not None else request.request_id
        self.parent, self.index, self.queue = parent, index, queue
        self.prompt, self.prompt_token_ids = prompt, request.prompt_token_ids
        self.detokenizer = IncrementalDetokenizer.from_request(tokenizer, request)
        self.logprobs = (LogprobsAccumulator(params, token_texts if params.detokenize else None,
                                             request.prompt_token_ids)
                         if params.logprobs is not None or params.prompt_logprobs is not None else None)
        self.num_cached_tokens = 0
        self.stats = RequestStateStats(arrival_time=request.arrival_time) if log_stats else None
        self.max_tokens = params.max_tokens  # for the max-tokens histogram
        self.text = ""  # released text (CUMULATIVE)
        self.text_parts: list[str] = []  # released text (FINAL_ONLY: joined once)
        self.token_ids: list[int] = []  # all output ids (not kept for DELTA)
        # Every token the core generated so far (for a resubmission after a core restart, and
        # stream_interval); CUMULATIVE and FINAL_ONLY keep every output id anyway: one list.
        self.generated: list[int] = self.token_ids if self._keeps_token_ids else []
        self.resume = ResumeRecord(request)  # what a resubmission needs (frontend/recovery.py)
        # stream_interval: len(generated) when an output last went out, and a DELTA output held
        # back since (its text, ids and logprobs go out with the next one).
        self.sent_tokens = 0
        self.held: CompletionOutput | None = None

    def update(self, out: EngineCoreOutput, step: "Step | None" = None) -> CompletionOutput | None:
        """Apply one core output (of the core message `step`, whose IterationStats it feeds when
        stats are on); returns the completion to emit, if any. A finished completion for an
        output the core did not finish was ended by a stop string, here."""
        new_ids, finish = out.new_token_ids, out.finish_reason
        resume = self.resume
        resume.started = True  # any output: this core started it (see ResumeRecord)
        text, stop_str, used = self.detokenizer.step_tokens(new_ids, finish)
        if used < len(new_ids):  # a stop string inside a speculative run: the tokens after it go
            out = _first_tokens(out, used)
            new_ids = out.new_token_ids
        if new_ids and not self._keeps_token_ids:
            self.generated.extend(new_ids)
        if out.new_prompt_logprobs is not None:
            resume.num_prompt_lp_rows += len(out.new_prompt_logprobs.ranks)
        if out.num_cached_tokens:
            self.num_cached_tokens = out.num_cached_tokens
        if self.logprobs is not None:
            self.logprobs.add(out)
        if self.stats is not None and step is not None:
            step.stats.update_from_output(out, step.timestamp, len(self.prompt_token_ids), self.stats)
        if stop_str is not None:
            return self._completion(text, new_ids, _STOP_STR, stop_str)
        if finish is None:
            return self._completion(text, new_ids, None, None)
        return self._completion(text, new_ids, _FINISH_STR[finish], out.stop_reason)

    def _completion(self, text: str, new_ids: list[int], finish: str | None,
                    stop_reason: int | str | None) -> CompletionOutput | None:
        raise NotImplementedError


class _DeltaState(RequestState):
    """DELTA: only what is new (nothing is kept)."""

    __slots__ = ()
    _keeps_token_ids = False
    output_kind_is_delta = True

    def _completion(self, text: str, new_ids: list[int], finish: str | None,
                    stop_reason: int | str | None) -> CompletionOutput | None:
        if finish is None and not new_ids:
            return None  # e.g. a prompt-logprobs chunk of a chunked prefill
        logprobs, cumulative = _NO_LOGPROBS if self.logprobs is None else self.logprobs.sample()
        return CompletionOutput(self.index, text, new_ids, cumulative, logprobs, finish, stop_reason)


class _CumulativeState(RequestState):
    """CUMULATIVE: everything so far; an output is a snapshot, never a view of later state."""

    __slots__ = ()

    def _completion(self, text: str, new_ids: list[int], finish: str | None,
                    stop_reason: int | str | None) -> CompletionOutput | None:
        if finish is None and not new_ids:
            return None
        self.token_ids.extend(new_ids)
        if text:
            self.text += text
        logprobs, cumulative = _NO_LOGPROBS if self.logprobs is None else self.logprobs.sample()
        token_ids = self.token_ids if finish is not None else self.token_ids[:]
        return CompletionOutput(self.index, self.text, token_ids, cumulative, logprobs, finish, stop_reason)


class _FinalOnlyState(RequestState):
    """FINAL_ONLY: one output, at the finish."""

    __slots__ = ()

    def _completion(self, text: str, new_ids: list[int], finish: str | None,
                    stop_reason: int | str | None) -> CompletionOutput | None:
        self.token_ids.extend(new_ids)
        if text:
            self.text_parts.append(text)
        if finish is None:
            return None
        logprobs, cumulative = _NO_LOGPROBS if self.logprobs is None else self.logprobs.sample()
        return CompletionOutput(self.index, "".join(self.text_parts), self.token_ids, cumulative,
                                logprobs, finish, stop_reason)


STATE_CLASS: dict[RequestOutputKind, type[RequestState]] = {
    RequestOutputKind.CUMULATIVE: _CumulativeState, RequestOutputKind.DELTA: _DeltaState,
    RequestOutputKind.FINAL_ONLY: _FinalOnlyState}


class Step(NamedTuple):
    """One core message being processed with stats on: its IterationStats and timestamp."""

    stats: IterationStats
    timestamp: float
