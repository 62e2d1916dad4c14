"""The driver's half of a step after the forward: sampling the rows that sample, scoring the
prompt tokens of the requests that asked for prompt logprobs, each request isolated.

Isolation (a failure one request explains fails that request alone; the step completes for the
others, whose results are those of an undisturbed run):

- sampling that raises is retried on halves of the rows until each failing row stands alone
  (a row's token does not depend on its batch: DESIGN.md's determinism rule);
- a row whose masks left no token (NO_TOKEN from the sampler) fails as the request's own
  mistake (`invalid_req_ids`: InvalidRequestError, HTTP 400), naming the settings;
- prompt logprobs are computed request by request, so one that raises fails alone.

When every row (or every prompt-logprob request) of a step fails on its own, and there is more
than one, no single request explains it (device, bug): that is raised, for the engine.

Speculative decoding: a request verifying k proposals has k + 1 consecutive sampling rows
(worker/spec_decode.py): row j is sampled at position len(tokens) + j with the proposals
before it as history, and the request gets `verify`'s tokens, their logprobs one row each.
A row left with no token cuts the run there (the request fails if it is the first). A
structured-output request's k + 1 rows are all masked, row j with its grammar's state after
the proposals before it (the core appends those masks to the step's bitmask).
"""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch

from tidal.protocol.messages import LogprobsArrays, ModelRunnerOutput
from tidal.protocol.request_rules import num_logprobs
from tidal.protocol.sampling_params import SamplingParams
from tidal.utils.logging_utils import summarize_exception
from tidal.worker import logprobs as logprobs_mod
from tidal.worker.block_ops import argmax
from tidal.worker.logits_processors import (NO_TOKEN, apply_token_bitmask, argmax_is_masked, every_token_masked,
                                            needs_output_history)
from tidal.worker.sampler import Sampler, SamplingMetadata
from tidal.worker.spec_decode import grammar_proposal_rows, row_layout, verify

if TYPE_CHECKING:
    from tidal.worker.model_runner import CachedRequestState, _Batch

logger = logging.getLogger(__name__)


def _plain_greedy(sp: SamplingParams) -> bool:
    """Greedy with nothing that changes or reports the logits: the sample is their argmax."""
    return (sp.sampling_type_greedy and sp.logprobs is None and not _reads_outputs(sp)
            and not sp.uses_logits_processors)


def _reads_outputs(sp: SamplingParams) -> bool:
    return bool(sp.min_tokens or sp.presence_penalty or sp.frequency_penalty
                or sp.repetition_penalty != 1.0 or needs_output_history(sp))


class StepSampling:
    """ModelRunner's sampling and prompt-logprob methods (a mixin: the runner owns the state)."""

    requests: dict[str, CachedRequestState]
    sampler: Sampler
    vocab_size: int
    logprobs_mode: str

    def _sample(self, batch: _Batch, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        # Speculative rows (None: one row per request, the plain layout).
        layout = row_layout(batch.sample_rows, batch.spec) if batch.spec else None
        if batch.grammar_rows:
            # First, so that everything after (greedy argmax, sampling, the logprobs reported)
            # sees the masked distribution, as in vLLM.
            self._apply_grammar_bitmask(batch, logits, None if layout is None else layout[0])
        states = [self.requests[batch.req_ids[i]] for i in batch.sample_rows]
        if all(_plain_greedy(st.sampling_params) for st in states):
            # Nothing but an argmax to do: skip building the per-row sampling tensors.
            tokens = argmax(logits)
            if batch.grammar_rows:  # a grammar's bitmask is the only mask such rows can have
                tokens = tokens.masked_fill(argmax_is_masked(logits, tokens), NO_TOKEN)
            self._take_tokens(batch, states, self._emitted(batch, tokens.tolist(), layout), out)
            return
        # Token histories are copied only for rows whose sampling reads them (penalties,
        # min_tokens): the copy grows with the sequence and would run every step for every row.
        empty: list[int] = []
        params = [st.sampling_params for st in states]
        prompts = [st.token_ids[: st.num_prompt_tokens] if st.sampling_params.repetition_penalty != 1.0 else empty
                   for st in states]
        outputs = [st.token_ids[st.num_prompt_tokens:] if _reads_outputs(st.sampling_params) else empty
                   for st in states]
        positions = [len(st.token_ids) for st in states]
        eos = [st.eos_token_id for st in states]
        grammar = [row for row, i in enumerate(batch.sample_rows) if batch.req_ids[i] in batch.grammar_rows]
        if layout is not None:  # row j of a request: position + j, its proposals before j as history
            firsts, counts = layout
            grammar = [firsts[row] + j for row in grammar for j in range(counts[row])]  # all masked
            rows = [(r, j) for r, c in enumerate(counts) for j in range(c)]
            drafts = [batch.spec.get(i, empty) for i in batch.sample_rows]
            params = [params[r] for r, _ in rows]
            prompts = [prompts[r] for r, _ in rows]
            outputs = [outputs[r] + drafts[r][:j] if j and outputs[r] is not empty else outputs[r]
                       for r, j in rows]
            positions = [positions[r] + j for r, j in rows]
            eos = [eos[r] for r, _ in rows]
        md = SamplingMetadata.build(
            params=params, prompt_token_ids=prompts, output_token_ids=outputs, positions=positions,
            eos_token_ids=eos, vocab_size=self.vocab_size, device=logits.device,
            logprobs_mode=self.logprobs_mode, grammar_rows=grammar)
        result = self.sampler(logits, md)
        emitted = self._emitted(batch, result.sampled_token_ids.tolist(), layout)
        if result.logprobs is not None:
            token_ids = result.logprobs.token_ids.cpu().numpy()
            lps = result.logprobs.logprobs.cpu().numpy()
            ranks = result.logprobs.ranks.cpu().numpy()
            for row, st in enumerate(states):
                n = len(emitted[row])
                if st.sampling_params.logprobs is not None and n:
                    first = row if layout is None else layout[0][row]
                    k = num_logprobs(st.sampling_params.logprobs, self.vocab_size)
                    out.logprobs[st.req_id] = LogprobsArrays(
                        token_ids[first: first + n, : k + 1].copy(), lps[first: first + n, : k + 1].copy(),
                        ranks[first: first + n].copy())
        self._take_tokens(batch, states, emitted, out)

    @staticmethod
    def _emitted(batch: _Batch, sampled: list[int], layout: tuple[list[int], list[int]] | None) -> list[list[int]]:
        """Per sampling request, the tokens it emits ([]: its first row has no token left):
        its one sample, or with proposals the verified run, cut before a row with no token."""
        if layout is None:
            return [[] if t == NO_TOKEN else [t] for t in sampled]
        emitted: list[list[int]] = []
        for first, count, i in zip(*layout, batch.sample_rows):
            tokens = [sampled[first]] if count == 1 else verify(sampled[first: first + count], batch.spec[i])
            if NO_TOKEN in tokens:
                tokens = tokens[: tokens.index(NO_TOKEN)]
            emitted.append(tokens)
        return emitted

    def _take_tokens(self, batch: _Batch, states: list[CachedRequestState], emitted: list[list[int]],
                     out: ModelRunnerOutput) -> None:
        """Request i's tokens into `out`; one whose first row has no token fails instead."""
        for row, i in enumerate(batch.sample_rows):
            if emitted[row]:
                out.sampled_token_ids[i] = emitted[row]
                continue
            st = states[row]
            error = every_token_masked(st.sampling_params, st.token_ids[st.num_prompt_tokens:], st.eos_token_id,
                                       st.req_id in batch.grammar_rows)
            out.sampled_token_ids[i] = []
            out.logprobs.pop(st.req_id, None)
            out.failed_req_ids[st.req_id] = error
            if st.req_id not in out.invalid_req_ids:
                out.invalid_req_ids.append(st.req_id)
            logger.debug("request %r fails alone: %s", st.req_id, error)  # the core logs it

    def _sample_isolating(self, batch: _Batch, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """`_sample`, but a failure one request explains fails that request alone: the rows are
        retried in halves (sampling is a pure function of each row's seed and position, so a
        row's token does not depend on the batch it is in) until each failing row stands alone,
        and its request goes to `out.failed_req_ids`. When every row fails on its own too, no
        single request explains it (device, sampler bug): that is raised, for the engine."""
        try:
            self._sample(batch, logits, out)
            return
        except Exception as e:
            self.sampler.reset_buffers()  # a draw that raised midway may leave them dirty
            if len(batch.sample_rows) == 1:
                self._record_failure(batch, batch.sample_rows[0], e, out)
                return
        failed: dict[int, Exception] = {}
        self._sample_apart(batch, logits, list(range(len(batch.sample_rows))), out, failed)
        if len(failed) == len(batch.sample_rows):
            raise next(iter(failed.values()))
        for row, e in failed.items():
            self._record_failure(batch, batch.sample_rows[row], e, out)

    def _sample_apart(self, batch: _Batch, logits: torch.Tensor, rows: list[int], out: ModelRunnerOutput,
                      failed: dict[int, Exception]) -> None:
        """Sample `rows` (indices into batch.sample_rows) of a batch that failed, in halves."""
        halves = [rows] if len(rows) == 1 else [rows[: len(rows) // 2], rows[len(rows) // 2:]]
        layout = row_layout(batch.sample_rows, batch.spec) if batch.spec else None
        for half in halves:
            sub = dataclasses.replace(batch, sample_rows=[batch.sample_rows[r] for r in half])
            index = half if layout is None else [layout[0][r] + j for r in half for j in range(layout[1][r])]
            try:
                self._sample(sub, logits[index], out)
            except Exception as e:
                self.sampler.reset_buffers()
                if len(half) == 1:
                    failed[half[0]] = e
                else:
                    self._sample_apart(batch, logits, half, out, failed)

    def _record_failure(self, batch: _Batch, i: int, e: Exception, out: ModelRunnerOutput,
                        what: str = "sampling") -> None:
        """Batch index `i` failed (`what`: its sampling, or its prompt logprobs): no token, no
        logprobs (a failed attempt may have written some), and the reason for the core."""
        req_id = batch.req_ids[i]
        out.sampled_token_ids[i] = []
        out.logprobs.pop(req_id, None)
        out.prompt_logprobs.pop(req_id, None)
        if req_id in out.invalid_req_ids:  # an exception is the engine's, not the request's
            out.invalid_req_ids.remove(req_id)
        out.failed_req_ids[req_id] = f"{what} failed for this request: {summarize_exception(e)}"
        logger.error("%s failed for request %r alone: %s", what, req_id, out.failed_req_ids[req_id])

    @staticmethod
    def _apply_grammar_bitmask(batch: _Batch, logits: torch.Tensor, firsts: list[int] | None = None) -> None:
        """Mask the constrained rows of `logits` in place: one per batch.sample_rows, or with
        proposals (`firsts`: each request's first logits row) all 1 + k rows of a request,
        row j with the grammar's mask after its proposals 0..j-1 (grammar_proposal_rows'
        layout). Keyed by request id, so it serves a retry on a subset of the rows too."""
        assert batch.grammar_bitmask is not None
        rows: list[int] = []
        masks: list[int] = []
        extra: dict[str, int] = {}
        if firsts is not None and batch.spec:
            ordered = sorted(batch.grammar_rows, key=batch.grammar_rows.__getitem__)  # the core's id order
            extra = grammar_proposal_rows(ordered, {batch.req_ids[i]: d for i, d in batch.spec.items()})
        for row, i in enumerate(batch.sample_rows):
            rid = batch.req_ids[i]
            j = batch.grammar_rows.get(rid)
            if j is None:
                continue
            first = row if firsts is None else firsts[row]
            rows.append(first)
            masks.append(j)
            if rid in extra:
                n = len(batch.spec[i])
                rows.extend(range(first + 1, first + 1 + n))
                masks.extend(range(extra[rid], extra[rid] + n))
        if rows:
            apply_token_bitmask(logits, batch.grammar_bitmask[masks], rows)

    def _prompt_logprobs(self, batch: _Batch, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Each prompt-logprob request's rows of `logits` (in batch.prompt_lp order), scored
        apart: one that raises fails alone (see the module's rule for all of them failing)."""
        failed: dict[str, Exception] = {}
        attempted = 0
        offset = 0
        for req_id, _, rows, first_target in batch.prompt_lp:
            part = logits[offset: offset + rows]
            offset += rows
            if req_id in out.failed_req_ids:  # its sampling failed: it ends this step
                continue
            attempted += 1
            st = self.requests[req_id]
            try:
                targets = torch.tensor(st.token_ids[first_target: first_target + rows], dtype=torch.long,
                                       device=logits.device)
                k = num_logprobs(st.sampling_params.prompt_logprobs, self.vocab_size)
                # Looked up in its module at each call (the tests' fault injection replaces it).
                out.prompt_logprobs[req_id] = logprobs_mod.compute_prompt_logprobs(part, targets, k).to_arrays()
            except Exception as e:
                failed[req_id] = e
        if len(failed) > 1 and len(failed) == attempted:
            raise next(iter(failed.values()))
        for req_id, e in failed.items():
            self._record_failure(batch, batch.req_ids.index(req_id), e, out, what="prompt logprobs")
