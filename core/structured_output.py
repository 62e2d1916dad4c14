"""Structured outputs in the engine core: xgrammar grammars compiled off the busy loop, one
matcher per request, and the packed token bitmask of each step (vLLM V1's
StructuredOutputManager with its xgrammar backend).

A constrained request's life:
1. `EngineCore.add_request` -> `grammar_init`: its grammar's compile is queued in the compile
   pool (core/grammar_compile.py: child processes, so a compile can be stopped; compiles are
   cached by their effective options, `grammar_key`), and the request enters the scheduler as
   WAITING_FOR_GRAMMAR, which the scheduler passes over: a slow schema never stalls the other
   requests' steps, and these requests do not count as waiting for admission control.
2. Before each schedule, `update_grammars`: a request whose compile finished gets its matcher
   (advanced through any output tokens it already has: a request resumed after a core restart)
   and becomes WAITING; a failed one (invalid spec, past grammar_compile_timeout_s, a child
   that died) is returned, for the engine to end it alone with an error.
3. After the schedule, `fill_bitmask`: one bitmask row per constrained request that samples
   this step, shipped in the SchedulerOutput; the worker masks those rows' logits. A request
   that verifies speculative proposals (core/spec_decode.py) gets one more row per proposal,
   appended after those (worker/spec_decode.py's `grammar_proposal_rows`): the mask after the
   proposals before it, made by advancing the matcher over them and rolling it back.
4. The scheduler advances the matcher with each token it keeps (`accept_token`); a matcher that
   reaches its end finishes the request with finish_reason "stop".
5. A request ended from outside (abort, a gone front-end) is `release`d: a compile that no
   other waiting request shares is cancelled (its child killed), so it burns no more CPU.

JSON grammars bound the whitespace between two tokens (`max_whitespace_cnt`: the request's,
else the engine's structured_outputs_config, 20 by default): without a bound a model whose
vocabulary has long whitespace tokens can emit whitespace until max_tokens.

Only compiling runs off the busy-loop thread; matchers are touched by it alone. Tokens of a
step that an abort raced are never accepted (the scheduler drops them before its update), and a
preempted request keeps its output tokens, so its matcher state stays right through recompute.
xgrammar (which imports torch) and the tokenizer are loaded on the first constrained request.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from tidal.core.grammar_compile import (
    CompileJob,
    CompilePool,
    CompileTask,
    InvalidGrammarError,
    WorkerInit,
    max_compile_threads,
)
from tidal.protocol.config import EngineConfig
from tidal.protocol.structured_outputs import StructuredOutputsParams
from tidal.utils.logging_utils import summarize_exception

if TYPE_CHECKING:
    from tidal.core.request import Request

logger = logging.getLogger(__name__)

# (kind, spec text, any_whitespace, max_whitespace_cnt): what a compiled grammar depends on.
GrammarKey = tuple[str, str, bool, "int | None"]
# Compiles (jobs) kept for reuse, oldest dropped first: mostly to share one compile among
# requests that arrive together (n > 1, a batch); each compile child's xgrammar compiler keeps
# its own cache too, bounded in bytes.
_MAX_CACHED_GRAMMARS = 64


class GrammarFailure(NamedTuple):
    """A request that cannot go on for its grammar, for the engine to end alone: `invalid`
    when the request's own spec explains it (it does not compile, or not within the time
    limit; HTTP 400), else the engine's failure (a compile process that died, a mask error)."""

    request: "Request"
    error: str
    invalid: bool


class GrammarConflictError(ValueError):
    """The grammar forbids the token sampled under the request's own other settings: they
    masked every token the grammar allows. The request's mistake (HTTP 400), not the engine's."""


class StructuredOutputRequest:
    """One request's grammar: the compile's future, then its matcher (busy-loop thread only)."""

    def __init__(self, params: StructuredOutputsParams, job: CompileJob) -> None:
        self.params = params
        self.job = job
        self.matcher: Any = None  # xgrammar.GrammarMatcher once the grammar is ready

    @property
    def future(self) -> "cf.Future[Any]":
        return self.job.future

    @property
    def ready(self) -> bool:
        return self.matcher is not None

    def accept_token(self, token_id: int) -> None:
        """Advance the matcher by one sampled token; ValueError when the grammar forbids it
        (the mask allowed it, so only a row whose every allowed token was masked by something
        else, e.g. min_tokens forbidding the EOS that ends the grammar, gets here)."""
        if not self.matcher.accept_token(token_id):
            raise GrammarConflictError(
                f"token {token_id} is not allowed by the request's structured output grammar "
                f"({self.params.kind}); another setting (min_tokens, allowed_token_ids, bad_words) "
                "may have masked every token the grammar allows")

    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def num_valid_proposals(self, proposals: Sequence[int]) -> int:
        """How many leading `proposals` the grammar takes one after another without ending on
        one (a row after a forbidden or a final proposal would never count). The matcher is
        left as it was (rolled back)."""
        matcher = self.matcher
        accepted = 0
        try:
            for t in proposals:
                if t < 0 or not matcher.accept_token(t):
                    return accepted
                accepted += 1
                if matcher.is_terminated():
                    return accepted - 1
            return accepted
        finally:
            if accepted:
                matcher.rollback(accepted)

    def fill_proposal_masks(self, proposals: Sequence[int], bitmask: np.ndarray, first_row: int) -> None:
        """Rows first_row + j of `bitmask`: the mask after proposals 0..j, i.e. of the row that
        follows proposal j. From a proposal the grammar forbids (or one it ends on) on, every
        token is allowed: those rows' samples never count (the proposal cannot be accepted, or
        the request stops on it). The matcher is left as it was (rolled back)."""
        matcher = self.matcher
        accepted = 0
        try:
            for j, t in enumerate(proposals):
                if t < 0 or matcher.is_terminated() or not matcher.accept_token(t):
                    bitmask[first_row + j:first_row + len(proposals)] = -1
                    return
                accepted += 1
                if matcher.is_terminated():
                    bitmask[first_row + j:first_row + len(proposals)] = -1
                    return
                matcher.fill_next_token_bitmask(bitmask, first_row + j)
        finally:
            if accepted:
                matcher.rollback(accepted)


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size  # the model's (the logits' width), maybe past the tokenizer's
        self.bitmask_width = (vocab_size + 31) // 32
        self._pool: CompilePool | None = None  # started on the first constrained request
        self._tokenizer_info: Any = None  # xgrammar.TokenizerInfo, loaded on a pool thread
        self._tokenizer_error: str | None = None  # why the tokenizer did not load, once it did not
        self._tokenizer_lock = threading.Lock()
        self._cache: dict[GrammarKey, CompileJob] = {}
        # Compiling (WAITING_FOR_GRAMMAR), until readied, failed or released; and how many of
        # them wait for each job (a job none waits for any more is cancelled).
        self._pending: dict[str, Request] = {}
        self._waiters: dict[CompileJob, int] = {}
        self._active: dict[str, Request] = {}  # with a matcher, until they finish

    # ------------------------------------------------------------------ compile
    def grammar_key(self, params: StructuredOutputsParams) -> GrammarKey:
        """The request's constraint with the engine's settings merged in (disable_any_whitespace
        if either sets it; the request's max_whitespace_cnt, else the engine's)."""
        kind, text, disable_ws, max_ws = params.key()
        engine = self.config.structured_outputs_config
        if kind not in ("json", "json_object"):
            return kind, text, True, None  # whitespace options only shape JSON grammars
        any_ws = not (disable_ws or engine.disable_any_whitespace)
        bound = (max_ws if max_ws is not None else engine.max_whitespace_cnt) if any_ws else None
        return kind, text, any_ws, bound

    def grammar_init(self, request: Request) -> None:
        """Queue the compile of `request`'s grammar (a cached one is reused) and attach its
        state; the scheduler holds the request back until `update_grammars` readies it."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = self.grammar_key(params)
        job = self._cache.get(key)
        if job is None or job.future.cancelled() or (job.future.done() and job.future.exception() is not None):
            job = self._submit(key)
            if len(self._cache) >= _MAX_CACHED_GRAMMARS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = job
        request.structured_output_request = StructuredOutputRequest(params, job)
        self._pending[request.request_id] = request
        self._waiters[job] = self._waiters.get(job, 0) + 1

    def _submit(self, key: GrammarKey) -> CompileJob:
        kind, text, any_ws, bound = key
        if self._pool is None:
            self._pool = CompilePool(self._worker_init, self._deserialize)
        if kind == "choice":  # compiled as the EBNF of its choices
            kind, text = "grammar", choice_as_grammar(json.loads(text))
        task = CompileTask(kind, text, any_whitespace=any_ws, max_whitespace_cnt=bound)
        return self._pool.submit(task, self.config.grammar_compile_timeout_s)

    def _get_tokenizer_info(self) -> Any:
        """The model's vocabulary as xgrammar sees it (pool threads; loads the tokenizer once)."""
        with self._tokenizer_lock:
            if self._tokenizer_error is not None:  # tried once: each request is not to pay again
                raise ValueError(self._tokenizer_error)
            if self._tokenizer_info is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                cfg = self.config
                try:
                    tokenizer = AutoTokenizer.from_pretrained(
                        cfg.tokenizer_path, trust_remote_code=cfg.trust_remote_code,
                        revision=cfg.tokenizer_revision, use_fast=cfg.tokenizer_mode != "slow")
                except Exception as e:
                    self._tokenizer_error = (f"structured outputs need the model's tokenizer, which could not be "
                                             f"loaded from {cfg.tokenizer_path!r}: {summarize_exception(e)}")
                    raise ValueError(self._tokenizer_error) from None
                self._tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
            return self._tokenizer_info

    def _worker_init(self) -> WorkerInit:
        return WorkerInit(self._get_tokenizer_info().serialize_json(), max_compile_threads())

    def _deserialize(self, grammar_json: str) -> Any:
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(grammar_json, self._get_tokenizer_info())

    def release(self, requests: list[Request]) -> None:
        """Forget requests ended from outside (aborted, their front-end gone, failed). A compile
        no other waiting request shares is cancelled and dropped from the cache: a queued one
        never starts, a running one has its process killed now."""
        for request in requests:
            self._active.pop(request.request_id, None)
            if self._pending.pop(request.request_id, None) is not None:
                self._unwait(request)

    def _unwait(self, request: Request) -> None:
        so = request.structured_output_request
        if so is None:
            return
        job = so.job
        left = self._waiters.get(job, 0) - 1
        if left > 0:
            self._waiters[job] = left
            return
        self._waiters.pop(job, None)
        if not job.future.done() and self._pool is not None:
            self._pool.cancel(job)
            for key, cached in list(self._cache.items()):
                if cached is job:
                    del self._cache[key]

    def num_waiting_for_grammar(self) -> int:
        """Requests held back for their grammar (not counted by admission control)."""
        return len(self._pending)

    # ------------------------------------------------------------------ per step
    def has_pending(self) -> bool:
        return bool(self._pending)

    def update_grammars(self) -> list[GrammarFailure]:
        """Ready the requests whose compile finished (status WAITING); returns those that
        cannot run, each with the reason, for the caller to end. Finished ones are dropped."""
        from tidal.core.request import RequestStatus

        failed: list[GrammarFailure] = []
        for rid, request in list(self._pending.items()):
            so = request.structured_output_request
            if request.is_finished():  # ended without `release` (defensive)
                del self._pending[rid]
                self._unwait(request)
                continue
            if so is None or not so.future.done():
                continue
            del self._pending[rid]
            self._unwait(request)
            try:
                so.matcher = self._new_matcher(request, so.future.result())
            except cf.CancelledError:
                failed.append(GrammarFailure(request, "its grammar's compile was cancelled", False))
                continue
            except Exception as e:
                # ValueError: the spec (invalid, too slow), or output that does not match it.
                failed.append(GrammarFailure(request, self._compile_error(so.params, e), isinstance(e, ValueError)))
                continue
            self._active[rid] = request
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING
        return failed

    @staticmethod
    def _compile_error(params: StructuredOutputsParams, e: Exception) -> str:
        """The text a failed compile ends its request with."""
        if isinstance(e, InvalidGrammarError):  # xgrammar's words about the spec
            return f"invalid structured_outputs.{params.kind}: {e}"
        if isinstance(e, ValueError):  # past the time limit; no tokenizer: already worded
            return str(e)
        return summarize_exception(e)

    def _new_matcher(self, request: Request, compiled: Any) -> Any:
        import xgrammar as xgr

        # The request's own stop tokens end the grammar (its EOS and stop_token_ids), so a
        # matcher terminates exactly where the scheduler would stop the request.
        stops = [t for t in [request.eos_token_id, *(request.sampling_params.stop_token_ids or [])]
                 if t is not None and 0 <= t < self.vocab_size]
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stops or None)
        for t in request.output_token_ids:  # tokens it already has (resumed after a restart)
            if not matcher.accept_token(t):
                raise ValueError(f"the request's output so far (token {t}) does not match its "
                                 f"structured output grammar ({request.sampling_params.structured_outputs.kind})")
        return matcher

    def wait_for_grammars(self, timeout_s: float) -> None:
        """Block until a pending compile finishes or `timeout_s` passes: a step with nothing to
        run but requests waiting for grammars sleeps here instead of spinning."""
        futures = [r.structured_output_request.future for r in self._pending.values()
                   if r.structured_output_request is not None]
        if futures:
            cf.wait(futures, timeout=timeout_s, return_when=cf.FIRST_COMPLETED)

    def fill_bitmask(self, scheduler_output: Any) -> list[GrammarFailure]:
        """Set `scheduler_output.structured_output_request_ids` / `grammar_bitmask` for the
        constrained requests that sample in this step. Costs nothing when none is active.
        Returns the requests whose matcher failed, with the reason, for the caller to end (the
        step's tokens of an ended request are dropped, so its row may go unmasked)."""
        if not self._active:
            return []
        scheduled = scheduler_output.num_scheduled_tokens
        grammars: list[StructuredOutputRequest] = []
        ids: list[str] = []
        failed: list[GrammarFailure] = []
        for rid, request in list(self._active.items()):
            if request.is_finished():
                del self._active[rid]
                continue
            n = scheduled.get(rid)
            # It samples iff this step's chunk reaches its last token (num_computed_tokens is
            # still the step's start here: the update has not run).
            if n is not None and request.num_computed_tokens + n >= request.num_tokens:
                so = request.structured_output_request
                if so is not None and not so.is_terminated():
                    ids.append(rid)
                    grammars.append(so)
        if not ids:
            return failed
        # Rows 0..len(ids)-1: each request's first row; then its proposal rows (speculative
        # decoding), request after request in `ids` order (grammar_proposal_rows' layout).
        spec = scheduler_output.scheduled_spec_decode_tokens or {}
        proposals = [spec.get(rid) or () for rid in ids]
        num_rows = len(ids) + sum(len(p) for p in proposals)
        bitmask = np.empty((num_rows, self.bitmask_width), dtype=np.int32)  # fresh: it travels
        extra = len(ids)
        for row, (so, drafts) in enumerate(zip(grammars, proposals)):
            try:
                so.matcher.fill_next_token_bitmask(bitmask, row)
                if drafts:
                    so.fill_proposal_masks(drafts, bitmask, extra)
            except Exception as e:
                # All allowed; the request is ended before its tokens count.
                bitmask[row] = -1
                bitmask[extra: extra + len(drafts)] = -1
                failed.append(GrammarFailure(self._active.pop(ids[row]), f"filling the token bitmask failed: "
                                                                         f"{summarize_exception(e)}", False))
            extra += len(drafts)
        scheduler_output.structured_output_request_ids = ids
        scheduler_output.grammar_bitmask = bitmask
        return failed

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()


def choice_as_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are `choices` (JSON string literals are EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
