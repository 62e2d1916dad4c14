"""ModelRunner: turns a SchedulerOutput into one forward pass over the paged KV cache.

It keeps per-request state across steps (token ids, block ids) so the core only sends deltas.
The tokens a request samples come back to the runner through the next SchedulerOutput (as
`new_token_ids`), never from its own sampler: every tensor-parallel rank then holds the same
state whether or not it sampled.

Step inputs live in persistent buffers (worker/input_batch.py): each request owns a block-table
row while it is in the runner's state, and a step fills buffer prefixes (no per-step tensor
allocation; on CUDA pinned staging and non-blocking copies, so the only host sync of a step is
reading the sampled ids). On CUDA, decode-only steps replay captured graphs
(worker/cuda_graphs.py, `capture_cuda_graphs`); on CPU, small decode-only steps replay their
recorded kernel calls (worker/cpu_graphs.py); everything else runs eagerly.

Speculative decoding (core/spec_decode.py): a request with proposals
(`SchedulerOutput.scheduled_spec_decode_tokens`) computes its last token and the proposals as
query rows; every one of those rows goes through the LM head and is sampled, and the request
returns the verified tokens (worker/spec_decode.py). The proposals never enter the runner's
token state: the accepted ones come back as `new_token_ids` like any sampled token. A draft
model's proposals are made here, before the step's forward pass (worker/draft_model.py).
"""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput
from tidal.protocol.sampling_params import SamplingParams
from tidal.utils.logging_utils import summarize_exception
from tidal.worker.attention import Attention
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.cpu_graphs import DEFAULT_SIZES as DEFAULT_CPU_GRAPH_SIZES
from tidal.worker.cpu_graphs import CpuGraphRunner, capture_cpu_graphs
from tidal.worker.cuda_graphs import CudaGraphRunner, backend_is_graph_safe, capture_sizes
from tidal.worker.draft_model import DraftProposer
from tidal.worker.forward_context import set_forward_context
from tidal.worker.input_batch import InputBatch
from tidal.worker.sampler import Sampler
from tidal.worker.step_sampling import StepSampling

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every token generated so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None
    row: int = -1  # its row of the InputBatch's block table


@dataclass
class _Batch:
    req_ids: list[str]
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata | None  # None when a CUDA graph replays the step
    sample_rows: list[int]  # batch indices of requests that sample this step
    # Flat token rows that go through the LM head (sampling rows, then prompt-logprob rows),
    # on the device; None when that is every token in order (a decode step where all sample).
    logits_index: torch.Tensor | None
    prompt_lp: list[tuple[str, int, int, int]]  # (req_id, first logits row, rows, first target pos)
    # Structured outputs: req_id -> its row of grammar_bitmask (SchedulerOutput's), for the
    # constrained requests that sample this step; empty (and None) when there are none.
    grammar_rows: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    graph_size: int | None = None  # the captured CUDA graph this step replays (padded size)
    num_tokens: int = 0
    # Speculative decoding: batch index -> the proposals it verifies. Each sampling request
    # has 1 + len(proposals) consecutive sampling rows (worker/spec_decode.row_layout).
    spec: dict[int, list[int]] = field(default_factory=dict)

    @property
    def num_sample_logits(self) -> int:
        """Logits rows of the sampling requests (one each, plus one per proposal)."""
        return len(self.sample_rows) + sum(len(d) for d in self.spec.values())


# Defaults of the sizes the persistent buffers are allocated for, when the constructor is not
# told (buffers grow past them if a step needs it, so these only matter for speed).
DEFAULT_MAX_NUM_SEQS = 256
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_MODEL_LEN = 2048


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor. On CPU the zeros come from calloc (numpy), which maps
    fresh pages the kernel zeroes on first touch: `torch.zeros` wrote all of a 2 GiB cache at
    start-up (~2 s), this costs nothing until a block is used. Aligned to 64 bytes (a cache
    line) for the kernels' vector loads."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -buf.ctypes.data % 64
    return torch.from_numpy(buf[start: start + nbytes]).view(dtype).view(shape)


class ModelRunner(StepSampling):
    """Per-request state and the forward pass; sampling and prompt logprobs, each request
    isolated, are StepSampling's (worker/step_sampling.py)."""

    def __init__(self, model: nn.Module, *, block_size: int, vocab_size: int, device: torch.device,
                 is_driver: bool = True, logprobs_mode: str = "raw_logprobs",
                 max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 max_model_len: int = DEFAULT_MAX_MODEL_LEN) -> None:
        self.model = model
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.is_driver = is_driver  # only the driver (rank 0) samples and answers
        self.sampler = Sampler()
        self.logprobs_mode = logprobs_mode  # EngineConfig.logprobs_mode: what sample logprobs report
        self.requests: dict[str, CachedRequestState] = {}
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.input_batch = InputBatch(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, block_size=block_size, device=device)
        self.cuda_graphs: CudaGraphRunner | None = None
        self.cpu_graphs: CpuGraphRunner | None = None  # recorded CPU decode steps (worker/cpu_graphs.py)
        # speculative_config with a draft model: fills the proposals before each forward pass
        # (worker/draft_model.py); its KV lives in the same blocks, in tensors of its own.
        self.drafter: DraftProposer | None = None

    def bind_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.drafter is not None:
            layers += self.drafter.attention_layers
        for layer in layers:
            shape = (num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
            layer.k_cache = zeroed_kv_tensor(shape, dtype, self.device)
            layer.v_cache = zeroed_kv_tensor(shape, dtype, self.device)
        self.input_batch.num_blocks = num_blocks  # block ids are checked against it from now on

    def capture_cuda_graphs(self, sizes: list[int] | None = None) -> None:
        """Capture decode graphs (worker/cuda_graphs.py) after the KV cache is bound; `sizes`
        overrides vLLM's size grid. A no-op (logged) off CUDA, under tensor parallelism, or
        when the attention backend cannot be captured."""
        if self.device.type != "cuda":
            logger.info("CUDA graphs: not captured (device %s)", self.device)
            return
        if self.input_batch.num_blocks is None:
            raise RuntimeError("capture_cuda_graphs needs the KV cache: call bind_kv_cache first")
        safe, backend = backend_is_graph_safe(self.device)
        if not safe:
            logger.info("CUDA graphs: not captured (attention backend %s is not graph-safe); "
                        "decodes run eagerly", backend)
            return
        if torch.distributed.is_available() and torch.distributed.is_initialized() \
                and torch.distributed.get_world_size() > 1:
            logger.info("CUDA graphs: not captured under tensor parallelism (collectives are not "
                        "captured yet); decodes run eagerly")
            return
        ib = self.input_batch
        graph_sizes = capture_sizes(ib.max_num_seqs, sizes, ib.max_num_tokens)
        if not graph_sizes:
            logger.info("CUDA graphs: no size to capture")
            return
        runner = CudaGraphRunner(self.model, ib, graph_sizes, self.max_model_len)
        try:
            runner.capture()
        except Exception as e:  # e.g. an op that syncs: the engine still serves, eagerly
            logger.error("CUDA graph capture failed, decodes run eagerly (enforce_eager=True "
                         "silences this): %s", summarize_exception(e))
            runner.graphs.clear()
            torch.cuda.synchronize(self.device)
            return
        self.cuda_graphs = runner

    def capture_cpu_graphs(self, num_speculative_tokens: int = 0) -> None:
        """Record small decode batches' kernel calls (worker/cpu_graphs.py) after the KV cache
        is bound and the GEMMs are warmed up; a no-op (logged) when the forward cannot be.
        With speculation, a single stream's verify step (1 + k rows) gets a size too."""
        if self.device.type != "cpu":
            return
        if self.input_batch.num_blocks is None:
            raise RuntimeError("capture_cpu_graphs needs the KV cache: call bind_kv_cache first")
        sizes = set(DEFAULT_CPU_GRAPH_SIZES)
        if num_speculative_tokens:  # (capture_cpu_graphs keeps the sizes the buffers hold)
            sizes.add(1 + num_speculative_tokens)
        self.cpu_graphs = capture_cpu_graphs(self.model, self.input_batch, self.max_num_seqs, self.max_model_len,
                                             tuple(sorted(sizes)))

    @property
    def graphs(self) -> CudaGraphRunner | CpuGraphRunner | None:
        return self.cuda_graphs if self.cuda_graphs is not None else self.cpu_graphs

    # ------------------------------------------------------------------ state
    def _update_states(self, so: SchedulerOutput) -> None:
        reqs = self.requests
        ib = self.input_batch
        for rid in so.finished_req_ids:  # finished, aborted or preempted: row freed
            if reqs.pop(rid, None) is not None:
                ib.remove_request(rid)
        for new in so.scheduled_new_reqs:  # new, or resumed after a preemption: a new row
            row = ib.add_request(new.req_id, new.block_ids)
            reqs[new.req_id] = CachedRequestState(
                new.req_id, list(new.prompt_token_ids) + list(new.output_token_ids),
                len(new.prompt_token_ids), new.sampling_params, list(new.block_ids),
                new.num_computed_tokens, new.eos_token_id, row)
        for c in so.scheduled_cached_reqs:
            st = reqs[c.req_id]
            st.token_ids.extend(c.new_token_ids)
            if c.num_dropped_blocks:  # blocks that held only rejected speculative rows
                keep = len(st.block_ids) - c.num_dropped_blocks
                if keep < 0:
                    raise ValueError(f"request {c.req_id!r}: {c.num_dropped_blocks} blocks dropped, "
                                     f"{len(st.block_ids)} held")
                ib.truncate_blocks(st.row, keep)
                del st.block_ids[keep:]
            if c.new_block_ids:
                ib.append_blocks(st.row, c.new_block_ids)
                st.block_ids.extend(c.new_block_ids)
            st.num_computed_tokens = c.num_computed_tokens

    def _prepare(self, so: SchedulerOutput) -> _Batch:
        req_ids = list(so.num_scheduled_tokens)
        num_scheduled = list(so.num_scheduled_tokens.values())
        reqs = self.requests
        bs = self.block_size
        rows: list[int] = []
        starts: list[int] = []
        tokens: list[int] = []
        decode_slots: list[int] = []  # used when every sequence decodes (one token each)
        sample_rows: list[int] = []
        prompt_lp_reqs: list[int] = []
        spec_tokens = so.scheduled_spec_decode_tokens
        spec: dict[int, list[int]] = {}
        for i, rid in enumerate(req_ids):
            st = reqs[rid]
            n = num_scheduled[i]
            start = st.num_computed_tokens
            end = start + n
            rows.append(st.row)
            starts.append(start)
            token_ids = st.token_ids
            drafts = spec_tokens.get(rid) if spec_tokens else None
            if drafts:  # its last token(s), then the proposals it verifies
                if end != len(token_ids) + len(drafts):
                    raise ValueError(f"request {rid!r}: {n} tokens scheduled from {start} with "
                                     f"{len(drafts)} proposals, but it has {len(token_ids)} tokens")
                tokens.extend(token_ids[start:])
                tokens.extend(drafts)
                spec[i] = drafts
            elif n == 1:  # a decode: plain ints, no per-row numpy
                tokens.append(token_ids[start])
                decode_slots.append(st.block_ids[start // bs] * bs + start % bs)
            else:
                tokens.extend(token_ids[start:end])
            if st.sampling_params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1:
                prompt_lp_reqs.append(i)
            if end >= len(token_ids):
                sample_rows.append(i)
        num_tokens = len(tokens)
        num_seqs = len(req_ids)
        graph_size = None
        graphs = self.graphs
        ib = self.input_batch
        if num_tokens == num_seqs and graphs is not None:
            graph_size = graphs.padded_size(num_seqs)
        elif (spec and self.cpu_graphs is not None and self.cuda_graphs is None and not prompt_lp_reqs
              and all(n == 1 + len(spec.get(i, ())) for i, n in enumerate(num_scheduled))):
            graph_size = self.cpu_graphs.padded_size(num_tokens)  # decodes and verifications only
        if graph_size is not None and num_tokens != num_seqs:
            # Each token a decode of its own (its position, its request's block table), which is
            # exactly its causal attention, as the KV of every row is written before any row
            # reads. The sampling below keeps the real layout.
            decode_rows = [row for row, n in zip(rows, num_scheduled) for _ in range(n)]
            positions = [p for start, n in zip(starts, num_scheduled) for p in range(start, start + n)]
            step = ib.prepare(decode_rows, positions, [1] * num_tokens, tokens, pad_to=graph_size)
            qsl = list(itertools.accumulate(num_scheduled, initial=0))
        else:
            step = ib.prepare(rows, starts, num_scheduled, tokens, pad_to=graph_size,
                              decode_slots=decode_slots if num_tokens == num_seqs else None)
            qsl = step.query_start_loc_list
        prompt_lp: list[tuple[str, int, int, int]] = []
        for i in prompt_lp_reqs:
            st = reqs[req_ids[i]]
            start = starts[i]
            # Hidden state at position p scores prompt token p+1.
            rows_lp = min(start + num_scheduled[i], st.num_prompt_tokens - 1) - start
            prompt_lp.append((st.req_id, qsl[i], rows_lp, start + 1))
        logits_index = None
        if prompt_lp or len(sample_rows) != num_tokens:
            # (len(sample_rows) == num_tokens means every token is the last of its sequence
            # and samples: the LM head takes the hidden states as they are.)
            if spec:  # a request verifying proposals samples its last 1 + len(proposals) rows
                index = np.asarray([r for i in sample_rows
                                    for r in range(qsl[i + 1] - 1 - len(spec.get(i, ())), qsl[i + 1])],
                                   dtype=np.int64)
            else:
                index = np.asarray(qsl[1:], dtype=np.int64)[sample_rows] - 1
            if prompt_lp:
                index = np.concatenate([index] + [np.arange(first, first + n, dtype=np.int64)
                                                  for _, first, n, _ in prompt_lp])
            logits_index = ib.upload_logits_index(index)
        metadata = None
        if graph_size is None:
            metadata = AttentionMetadata.build(
                slot_mapping=step.slot_mapping, query_start_loc=qsl, seq_lens=step.seq_lens_list,
                block_tables=step.block_table, block_size=self.block_size,
                query_start_loc_device=step.query_start_loc, seq_lens_device=step.seq_lens)
            metadata.block_tables_checked = True
        return _Batch(
            req_ids, step.input_ids, step.positions, metadata, sample_rows, logits_index, prompt_lp,
            {rid: i for i, rid in enumerate(so.structured_output_request_ids)}, so.grammar_bitmask,
            graph_size, num_tokens, spec)

    # ---------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput() if self.is_driver else None
        if self.drafter is not None:
            self.drafter.fill(self, so)
        batch = self._prepare(so)
        t0 = time.perf_counter()
        if batch.graph_size is not None:
            graphs = self.graphs
            assert graphs is not None
            hidden = graphs.replay(batch.graph_size, batch.num_tokens)
        else:
            with set_forward_context(batch.metadata):
                hidden = self.model(batch.input_ids, batch.positions)
        # Only rows that are sampled or scored go through the LM head.
        logits = None
        if batch.logits_index is None:
            if batch.num_tokens:
                logits = self.model.compute_logits(hidden)
        elif len(batch.logits_index):
            logits = self.model.compute_logits(hidden.index_select(0, batch.logits_index))
        forward_time = time.perf_counter() - t0
        if not self.is_driver:
            return None
        assert logits is not None or not batch.sample_rows
        logits = logits.float() if logits is not None else None
        out = ModelRunnerOutput(req_ids=batch.req_ids, forward_time_s=forward_time)
        out.sampled_token_ids = [[] for _ in batch.req_ids]
        num_sample = batch.num_sample_logits
        if batch.sample_rows:
            self._sample_isolating(batch, logits[:num_sample], out)
        if batch.prompt_lp:
            self._prompt_logprobs(batch, logits[num_sample:], out)
        return out
