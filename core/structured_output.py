"""Structured outputs in the engine core: xgrammar grammars compiled off the busy loop, one
matcher per request, and the packed token bitmask of each step (vLLM V1's
StructuredOutputManager with its xgrammar backend).

A constrained request's life:
1. `EngineCore.add_request` -> `grammar_init`: its grammar's compile is queued in a thread pool
   (compiled grammars are cached by `StructuredOutputsParams.key()`), and the request enters
   the scheduler as WAITING_FOR_GRAMMAR, which the scheduler passes over: a slow schema never
   stalls the other requests' steps.
2. Before each schedule, `update_grammars`: a request whose compile finished gets its matcher
   (advanced through any output tokens it already has: a request resumed after a core restart)
   and becomes WAITING; a failed one is returned, for the engine to end it alone with an error.
3. After the schedule, `fill_bitmask`: one bitmask row per constrained request that samples
   this step, shipped in the SchedulerOutput; the worker masks those rows' logits.
4. The scheduler advances the matcher with each token it keeps (`accept_token`); a matcher that
   reaches its end finishes the request with finish_reason "stop".

Only compiling runs in the pool; matchers are touched by the busy-loop thread alone. Tokens of a
step that an abort raced are never accepted (the scheduler drops them before its update), and a
preempted request keeps its output tokens, so its matcher state stays right through recompute.
xgrammar (which imports torch) and the tokenizer are loaded on the first constrained request.
"""
from __future__ import annotations

import concurrent.futures as cf
import json
import logging
import os
import threading
from typing import TYPE_CHECKING, Any

import numpy as np

from tidal.protocol.config import EngineConfig
from tidal.protocol.structured_outputs import StructuredOutputsParams
from tidal.protocol.utils import summarize_exception

if TYPE_CHECKING:
    from tidal.core.request import Request

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str, bool, bool]
# Compiles (futures) kept for reuse, oldest dropped first: mostly to share one compile among
# requests that arrive together (n > 1, a batch); xgrammar's compiler keeps its own cache too,
# bounded in bytes.
_MAX_CACHED_GRAMMARS = 64
_XGRAMMAR_CACHE_BYTES = 512 << 20  # vLLM's default (VLLM_XGRAMMAR_CACHE_MB=512)


class GrammarConflictError(ValueError):
    """The grammar forbids the token sampled under the request's own other settings: they
    masked every token the grammar allows. The request's mistake (HTTP 400), not the engine's."""


class StructuredOutputRequest:
    """One request's grammar: the compile's future, then its matcher (busy-loop thread only)."""

    def __init__(self, params: StructuredOutputsParams, future: "cf.Future[Any]") -> None:
        self.params = params
        self.future = future
        self.matcher: Any = None  # xgrammar.GrammarMatcher once the grammar is ready

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


class StructuredOutputManager:
    def __init__(self, config: EngineConfig, vocab_size: int) -> None:
        self.config = config
        self.vocab_size = vocab_size  # the model's (the logits' width), maybe past the tokenizer's
        self.bitmask_width = (vocab_size + 31) // 32
        self._executor: cf.ThreadPoolExecutor | None = None
        self._compiler: Any = None  # xgrammar.GrammarCompiler, built in the pool on first use
        self._compiler_lock = threading.Lock()
        self._cache: dict[GrammarKey, cf.Future[Any]] = {}
        self._pending: dict[str, Request] = {}  # compiling (WAITING_FOR_GRAMMAR)
        self._active: dict[str, Request] = {}  # with a matcher, until they finish

    # ------------------------------------------------------------------ compile
    def grammar_init(self, request: Request) -> None:
        """Queue the compile of `request`'s grammar (a cached one is reused) and attach its
        state; the scheduler holds the request back until `update_grammars` readies it."""
        params = request.sampling_params.structured_outputs
        assert params is not None
        key = params.key()
        future = self._cache.get(key)
        if future is None or (future.done() and future.exception() is not None):
            if self._executor is None:
                # One thread: compiles queue behind each other, and xgrammar's own compiler
                # threads do the parallel work; the busy loop keeps a core of its own.
                self._executor = cf.ThreadPoolExecutor(1, thread_name_prefix="tidal-grammar")
            future = self._executor.submit(self._compile, params)
            if len(self._cache) >= _MAX_CACHED_GRAMMARS:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = future
        request.structured_output_request = StructuredOutputRequest(params, future)
        self._pending[request.request_id] = request

    def _get_compiler(self) -> Any:
        with self._compiler_lock:
            if self._compiler is None:
                import xgrammar as xgr
                from transformers import AutoTokenizer

                cfg = self.config
                try:
                    tokenizer = AutoTokenizer.from_pretrained(
                        cfg.tokenizer_path, trust_remote_code=cfg.trust_remote_code,
                        revision=cfg.tokenizer_revision, use_fast=cfg.tokenizer_mode != "slow")
                except Exception as e:
                    raise ValueError(f"structured outputs need the model's tokenizer, which could not be "
                                     f"loaded from {cfg.tokenizer_path!r}: {summarize_exception(e)}") from None
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size)
                self._compiler = xgr.GrammarCompiler(info, max_threads=max(1, min(8, os.cpu_count() or 1)),
                                                     cache_limit_bytes=_XGRAMMAR_CACHE_BYTES)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (pool thread); ValueError naming what is wrong with the spec."""
        compiler = self._get_compiler()
        kind = params.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(params.json, any_whitespace=not params.disable_any_whitespace)
            if kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}',
                                                    any_whitespace=not params.disable_any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(params.regex)
            if kind == "choice":
                return compiler.compile_grammar(choice_as_grammar(params.choice or []))
            if kind == "grammar":
                return compiler.compile_grammar(params.grammar)
            return self._compile_structural_tag(compiler, params.structural_tag or "")
        except Exception as e:
            raise ValueError(f"invalid structured_outputs.{kind}: {_xgrammar_message(e)}") from None

    @staticmethod
    def _compile_structural_tag(compiler: Any, spec: str) -> Any:
        import xgrammar as xgr

        tag = json.loads(spec)
        if "structures" in tag:  # vLLM's original format: begin/schema/end items and triggers
            items = [xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                     for s in tag["structures"]]
            return compiler.compile_structural_tag(items, tag["triggers"])
        return compiler.compile_structural_tag(spec)

    # ------------------------------------------------------------------ per step
    def has_pending(self) -> bool:
        return bool(self._pending)

    def update_grammars(self) -> list[tuple[Request, str]]:
        """Ready the requests whose compile finished (status WAITING); returns those that
        cannot run, each with the reason, for the caller to end. Finished ones are dropped."""
        from tidal.core.request import RequestStatus

        failed: list[tuple[Request, str]] = []
        for rid, request in list(self._pending.items()):
            so = request.structured_output_request
            if request.is_finished():
                del self._pending[rid]
                continue
            if so is None or not so.future.done():
                continue
            del self._pending[rid]
            try:
                so.matcher = self._new_matcher(request, so.future.result())
            except Exception as e:
                failed.append((request, str(e) if isinstance(e, ValueError) else summarize_exception(e)))
                continue
            self._active[rid] = request
            if request.status == RequestStatus.WAITING_FOR_GRAMMAR:
                request.status = RequestStatus.WAITING
        return failed

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

    def fill_bitmask(self, scheduler_output: Any) -> list[tuple[Request, str]]:
        """Set `scheduler_output.structured_output_request_ids` / `grammar_bitmask` for the
        constrained requests that sample in this step. Costs nothing when none is active.
        Returns the requests whose matcher failed, with the reason, for the caller to end (the
        step's tokens of an ended request are dropped, so its row may go unmasked)."""
        if not self._active:
            return []
        scheduled = scheduler_output.num_scheduled_tokens
        matchers: list[Any] = []
        ids: list[str] = []
        failed: list[tuple[Request, str]] = []
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
                    matchers.append(so.matcher)
        if not ids:
            return failed
        bitmask = np.empty((len(ids), self.bitmask_width), dtype=np.int32)  # fresh: it travels
        for row, matcher in enumerate(matchers):
            try:
                matcher.fill_next_token_bitmask(bitmask, row)
            except Exception as e:
                bitmask[row] = -1  # all allowed; the request is ended before its token counts
                failed.append((self._active.pop(ids[row]), f"filling the token bitmask failed: "
                                                           f"{summarize_exception(e)}"))
        scheduler_output.structured_output_request_ids = ids
        scheduler_output.grammar_bitmask = bitmask
        return failed

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)


def choice_as_grammar(choices: list[str]) -> str:
    """EBNF whose only sentences are `choices` (JSON string literals are EBNF literals)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _xgrammar_message(e: Exception) -> str:
    """xgrammar's error text without its '[time] file.cc:line:' prefix."""
    text = str(e).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
        head, sep, rest = text.partition(": ")
        if sep and (".cc:" in head or ".h:" in head):
            text = rest
    return text.splitlines()[0] if text else type(e).__name__
