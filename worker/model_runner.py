"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged KV cache.

It keeps per-request state across steps (token ids, block ids) so the core only sends deltas.
The tokens a request samples come back to the runner through the next SchedulerOutput (as
`new_token_ids`), never from its own sampler: every tensor-parallel rank then holds the same
state whether or not it sampled.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from tidal.protocol.messages import LogprobsArrays, ModelRunnerOutput, SchedulerOutput
from tidal.protocol.request_rules import num_logprobs
from tidal.protocol.sampling_params import SamplingParams
from tidal.worker.attention import Attention, AttentionMetadata, set_forward_context
from tidal.worker.logits_processors import needs_output_history
from tidal.worker.sampler import Sampler, SamplingMetadata, argmax, compute_prompt_logprobs


def _plain_greedy(sp: SamplingParams) -> bool:
    """Greedy with nothing that changes or reports the logits: the sample is their argmax."""
    return (sp.sampling_type_greedy and sp.logprobs is None and not _reads_outputs(sp)
            and not sp.uses_logits_processors)


def _reads_outputs(sp: SamplingParams) -> bool:
    return bool(sp.min_tokens or sp.presence_penalty or sp.frequency_penalty
                or sp.repetition_penalty != 1.0 or needs_output_history(sp))


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token generated so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None


@dataclass
class _Batch:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    sample_rows: list[int]  # batch indices of requests that sample this step
    logits_indices: list[int]  # flat token index of each row that goes through the LM head
    prompt_lp: list[tuple[str, int, int, int]]  # (req_id, first logits row, rows, first target pos)


class ModelRunner:
    def __init__(self, model: nn.Module, *, block_size: int, vocab_size: int, device: torch.device,
                 is_driver: bool = True, logprobs_mode: str = "raw_logprobs") -> None:
        self.model = model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.is_driver = is_driver  # only the driver (rank 0) samples and answers
        self.sampler = Sampler()
        self.logprobs_mode = logprobs_mode  # EngineConfig.logprobs_mode: what sample logprobs report
        self.requests: dict[str, CachedRequestState] = {}

    def bind_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for layer in layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            layer.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)

    # ------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        reqs = self.requests
        for rid in so.finished_req_ids:
            reqs.pop(rid, None)
        for new in so.scheduled_new_reqs:
            reqs[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids),
                len(new.prompt_token_ids), new.sampling_params, list(new.block_ids),
                new.num_computed_tokens, new.eos_token_id)
        for c in so.scheduled_cached_reqs:
            st = reqs[c.req_id]
            st.token_ids.extend(c.new_token_ids)
            st.block_ids.extend(c.new_block_ids)
            st.num_computed_tokens = c.num_computed_tokens

    def _prepare(self, so: SchedulerOutput) -> _Batch:
        bs = self.block_size
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        tokens: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        logits_indices: list[int] = []
        prompt_lp: list[tuple[str, int, int, int]] = []
        max_blocks = max(len(st.block_ids) for st in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int64)
        for i, st in enumerate(states):
            n = so.num_scheduled_tokens[st.req_id]
            start = st.num_computed_tokens
            end = start + n
            tokens.extend(st.token_ids[start:end])
            block_table[i, : len(st.block_ids)] = st.block_ids
            if n == 1:  # a decode: plain ints, no per-row numpy
                positions.append(start)
                slots.append(st.block_ids[start // bs] * bs + start % bs)
            else:
                pos = np.arange(start, end, dtype=np.int64)
                positions.extend(pos.tolist())
                slots.extend((block_table[i, pos // bs] * bs + pos % bs).tolist())
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if st.sampling_params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1:
                # Hidden state at position p scores prompt token p+1.
                rows = min(end, st.num_prompt_tokens - 1) - start
                prompt_lp.append((st.req_id, qsl[i], rows, start + 1))
            if end >= len(st.token_ids):
                sample_rows.append(i)
                logits_indices.append(qsl[-1] - 1)
        dev = self.device
        metadata = AttentionMetadata.build(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=qsl, seq_lens=seq_lens,
            block_tables=torch.from_numpy(block_table).to(dev), block_size=bs)
        return _Batch(
            req_ids, torch.tensor(tokens, dtype=torch.long, device=dev),
            torch.tensor(positions, dtype=torch.long, device=dev), metadata,
            sample_rows, logits_indices, prompt_lp)

    # ---------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput() if self.is_driver else None
        batch = self._prepare(so)
        t0 = time.perf_counter()
        with set_forward_context(batch.metadata):
            hidden = self.model(batch.input_ids, batch.positions)
        # Only rows that are sampled or scored go through the LM head.
        lp_rows = [torch.arange(first, first + rows) for _, first, rows, _ in batch.prompt_lp]
        index = torch.tensor(batch.logits_indices, dtype=torch.long)
        if lp_rows:
            index = torch.cat([index, *lp_rows])
        logits = None
        if len(index):
            logits = self.model.compute_logits(hidden[index.to(hidden.device)])
        forward_time = time.perf_counter() - t0
        if not self.is_driver:
            return None
        assert logits is not None or not batch.sample_rows
        logits = logits.float() if logits is not None else None
        out = ModelRunnerOutput(req_ids=batch.req_ids, forward_time_s=forward_time)
        out.sampled_token_ids = [[] for _ in batch.req_ids]
        if batch.sample_rows:
            self._sample(batch, logits[: len(batch.sample_rows)], out)
        if batch.prompt_lp:
            self._prompt_logprobs(batch, logits[len(batch.sample_rows):], out)
        return out

    def _sample(self, batch: _Batch, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        states = [self.requests[batch.req_ids[i]] for i in batch.sample_rows]
        if all(_plain_greedy(st.sampling_params) for st in states):
            # Nothing but an argmax to do: skip building the per-row sampling tensors.
            sampled = argmax(logits).tolist()
            for row, i in enumerate(batch.sample_rows):
                out.sampled_token_ids[i] = [sampled[row]]
            return
        # Token histories are copied only for rows whose sampling reads them (penalties,
        # min_tokens): the copy grows with the sequence and would run every step for every row.
        empty: list[int] = []
        md = SamplingMetadata.build(
            params=[st.sampling_params for st in states],
            prompt_token_ids=[st.token_ids[: st.num_prompt_tokens]
                              if st.sampling_params.repetition_penalty != 1.0 else empty for st in states],
            output_token_ids=[st.token_ids[st.num_prompt_tokens:] if _reads_outputs(st.sampling_params)
                              else empty for st in states],
            positions=[len(st.token_ids) for st in states],
            eos_token_ids=[st.eos_token_id for st in states],
            vocab_size=self.vocab_size, device=logits.device, logprobs_mode=self.logprobs_mode)
        result = self.sampler(logits, md)
        sampled = result.sampled_token_ids.tolist()
        for row, i in enumerate(batch.sample_rows):
            out.sampled_token_ids[i] = [sampled[row]]
        if result.logprobs is not None:
            token_ids = result.logprobs.token_ids.cpu().numpy()
            lps = result.logprobs.logprobs.cpu().numpy()
            ranks = result.logprobs.ranks.cpu().numpy()
            for row, st in enumerate(states):
                if st.sampling_params.logprobs is not None:
                    k = num_logprobs(st.sampling_params.logprobs, self.vocab_size)
                    out.logprobs[st.req_id] = LogprobsArrays(
                        token_ids[row: row + 1, : k + 1].copy(), lps[row: row + 1, : k + 1].copy(),
                        ranks[row: row + 1].copy())

    def _prompt_logprobs(self, batch: _Batch, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        offset = 0
        for req_id, _, rows, first_target in batch.prompt_lp:
            st = self.requests[req_id]
            targets = torch.tensor(st.token_ids[first_target: first_target + rows], dtype=torch.long,
                                   device=logits.device)
            lp = compute_prompt_logprobs(logits[offset: offset + rows], targets,
                                         num_logprobs(st.sampling_params.prompt_logprobs, self.vocab_size))
            out.prompt_logprobs[req_id] = lp.to_arrays()
            offset += rows
