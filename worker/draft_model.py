"""A draft model's proposals, made in the target's worker at the start of each step
(speculative_config {"model": PATH, "num_speculative_tokens": k}; core/spec_decode.py has the
whole design).

The scheduler gives a speculating request k proposal rows of DRAFT_PENDING. Before the target's
forward pass, the drafter fills them: the draft model computes the request's tokens it has not
seen yet (the last one, t, at position p, and any it lags behind), samples d_0 from its logits,
then runs k - 1 one-row passes (d_{j-1} at position p + j) for d_1..d_{k-1}. The target then
verifies them in the same step, as it verifies n-gram proposals.

- Gumbel-coupled: draft token d_j is sampled by the target's own Sampler with the target
  request's parameters, history (its tokens, then d_0..d_{j-1}) and (seed, position) noise --
  the same exponential race the target runs at that position. A draft that agrees with the
  target's distribution then proposes the very token the target samples, so high agreement
  between the models becomes high acceptance at any temperature (not only greedy).
- The draft's KV cache has its own tensors but the target's block table and slots: position q
  of a request lives at the same slot in both. The scheduler allocated slots for positions
  p..p+k (the step's rows), so the draft's passes write only slots the request owns.
- `_computed[req]` counts the positions whose draft KV holds the request's real tokens. It
  never exceeds what the target has computed (rejected rows roll back in both), starts at 0
  for every request the runner (re)admits (so the draft never trusts KV it did not write: a
  prefix-cache hit computed only by the target would otherwise be read), and the first pass
  of a step catches up from it. A wrong draft KV could only cost acceptance: verification is
  exact, so the tokens emitted never depend on the draft.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tidal.protocol.messages import SchedulerOutput
from tidal.worker.attention import Attention
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.forward_context import set_forward_context
from tidal.worker.sampler import SamplingMetadata
from tidal.worker.block_ops import argmax
from tidal.worker.step_sampling import _plain_greedy, _reads_outputs

if TYPE_CHECKING:
    from tidal.worker.model_runner import CachedRequestState, ModelRunner


class DraftProposer:
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._computed: dict[str, int] = {}

    @property
    def attention_layers(self) -> list[Attention]:
        return [m for m in self.model.modules() if isinstance(m, Attention)]

    @torch.inference_mode()
    def fill(self, runner: ModelRunner, so: SchedulerOutput) -> None:
        """Replace the DRAFT_PENDING proposals of `so` (in place) with the draft's tokens. Runs
        on every rank (the draft's forward has the target's collectives), after the runner's
        state took in `so` and before its forward pass."""
        for rid in so.finished_req_ids:
            self._computed.pop(rid, None)
        for new in so.scheduled_new_reqs:
            self._computed[new.req_id] = 0
        spec = so.scheduled_spec_decode_tokens
        if not spec:
            return
        states = [runner.requests[rid] for rid in spec]
        ks = [len(spec[rid]) for rid in spec]
        drafts: list[list[int]] = [[] for _ in states]
        # Pass 1: every token the draft has not computed, up to the last one (t).
        starts = [min(self._computed.get(st.req_id, 0), st.num_computed_tokens) for st in states]
        spans = self._catch_up(runner, states, [(start, st.token_ids[start:]) for start, st in zip(starts, states)])
        self._extend(runner, states, drafts, spans)
        for j in range(1, max(ks)):  # passes 2..k: one row each, the previous proposal as input
            live = [i for i, k in enumerate(ks) if j < k]
            self._extend(runner, [states[i] for i in live], [drafts[i] for i in live],
                         [(len(states[i].token_ids) + j - 1, [drafts[i][-1]]) for i in live])
        for st, k, d in zip(states, ks, drafts):
            spec[st.req_id] = d
            self._computed[st.req_id] = len(st.token_ids) + k - 1  # t, d_0..d_{k-2}

    def _catch_up(self, runner: ModelRunner, states: list[CachedRequestState],
                  spans: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        """Forward passes (no sampling) over the spans' leading tokens until what is left fits
        one step of the runner's buffers (a new request's draft has its whole prompt to read):
        a larger step would reallocate them, and with them drop the CPU graphs for good. Every
        span keeps at least its last token for the pass that samples. The spans left."""
        budget = runner.input_batch.max_num_tokens
        while sum(len(tokens) for _, tokens in spans) > budget:
            room, chunk_states, chunk_spans, left = budget, [], [], []
            for st, (start, tokens) in zip(states, spans):
                take = min(len(tokens) - 1, room)
                if take > 0:
                    chunk_states.append(st)
                    chunk_spans.append((start, tokens[:take]))
                    room -= take
                    start, tokens = start + take, tokens[take:]
                left.append((start, tokens))
            if not chunk_spans:  # more requests than the budget has rows: the buffers grow
                break
            self._forward(runner, chunk_states, chunk_spans)
            spans = left
        return spans

    def _forward(self, runner: ModelRunner, states: list[CachedRequestState],
                 spans: list[tuple[int, list[int]]]) -> tuple[torch.Tensor, list[int]]:
        """The draft's forward over `spans[i]` (first position, its tokens) of request i: its
        KV written, (hidden states, query_start_loc) returned."""
        ib = runner.input_batch
        tokens = [t for _, span in spans for t in span]
        counts = [len(span) for _, span in spans]
        step = ib.prepare([st.row for st in states], [start for start, _ in spans], counts, tokens)
        qsl = step.query_start_loc_list
        metadata = AttentionMetadata.build(
            slot_mapping=step.slot_mapping, query_start_loc=qsl, seq_lens=step.seq_lens_list,
            block_tables=step.block_table, block_size=runner.block_size,
            query_start_loc_device=step.query_start_loc, seq_lens_device=step.seq_lens)
        metadata.block_tables_checked = True
        with set_forward_context(metadata):
            return self.model(step.input_ids, step.positions), qsl

    def _extend(self, runner: ModelRunner, states: list[CachedRequestState], drafts: list[list[int]],
                spans: list[tuple[int, list[int]]]) -> None:
        """One draft forward: request i computes `spans[i]` (first position, its tokens), and
        the next proposal is sampled from its last row and appended to drafts[i]."""
        hidden, qsl = self._forward(runner, states, spans)
        last = torch.tensor([q - 1 for q in qsl[1:]], dtype=torch.long, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, last)).float()
        for d, token in zip(drafts, self._sample(runner, states, drafts, logits)):
            d.append(token)

    @staticmethod
    def _sample(runner: ModelRunner, states: list[CachedRequestState], drafts: list[list[int]],
                logits: torch.Tensor) -> list[int]:
        """The target's draw at each request's next position, on the draft's logits."""
        params = [st.sampling_params for st in states]
        if all(_plain_greedy(sp) for sp in params):  # nothing but an argmax (the common case)
            return argmax(logits).tolist()
        empty: list[int] = []
        md = SamplingMetadata.build(
            params=params,
            prompt_token_ids=[st.token_ids[: st.num_prompt_tokens] if sp.repetition_penalty != 1.0 else empty
                              for st, sp in zip(states, params)],
            output_token_ids=[st.token_ids[st.num_prompt_tokens:] + d if _reads_outputs(sp) else empty
                              for st, sp, d in zip(states, params, drafts)],
            positions=[len(st.token_ids) + len(d) for st, d in zip(states, drafts)],
            eos_token_ids=[st.eos_token_id for st in states], vocab_size=runner.vocab_size,
            device=logits.device, logprobs_mode=runner.logprobs_mode, grammar_rows=[])
        md.max_num_logprobs = None  # the draft's logprobs are nobody's
        tokens = runner.sampler(logits, md).sampled_token_ids.tolist()
        # A row whose masks left nothing (NO_TOKEN < 0) proposes token 0: the target rejects it.
        return [max(int(t), 0) for t in tokens]


def check_draft_compatible(target_path: str, draft_path: str, target_cfg: object, draft_cfg: object) -> None:
    """ValueError unless the draft can propose the target's tokens: the same vocabulary size
    and, when the draft's directory has a tokenizer, the same token for every id (a draft
    without tokenizer files is read with the target's, as vLLM does)."""
    tv, dv = getattr(target_cfg, "vocab_size", None), getattr(draft_cfg, "vocab_size", None)
    if tv != dv:
        raise ValueError(f"speculative_config: the draft model at {draft_path} has vocab_size {dv}, the target "
                         f"{tv}: a draft model must share the target's tokenizer")
    from transformers import AutoTokenizer

    try:
        draft_vocab = AutoTokenizer.from_pretrained(draft_path).get_vocab()
    except (OSError, ValueError):
        return  # no tokenizer of its own
    target_vocab = AutoTokenizer.from_pretrained(target_path).get_vocab()
    if draft_vocab != target_vocab:
        by_id = {i: t for t, i in target_vocab.items()}
        diff = next(((t, i) for t, i in sorted(draft_vocab.items(), key=lambda kv: kv[1]) if by_id.get(i) != t),
                    None)
        where = f"id {diff[1]} is {diff[0]!r} in the draft's, {by_id.get(diff[1])!r} in the target's" if diff else (
            f"{len(draft_vocab)} tokens against {len(target_vocab)}")
        raise ValueError(f"speculative_config: the draft model at {draft_path} has another tokenizer than the "
                         f"target ({where}): a draft model must share the target's tokenizer")
