"""CUDA graphs for decode-only steps.

A decode step launches hundreds of small kernels whose launch cost exceeds their run time at
small batch sizes. `CudaGraphRunner` captures `model.forward` once per batch size (vLLM's
sizes: 1, 2, 4, 8, then every 8 up to 256, then every 16, capped at max_num_seqs) over the
model runner's persistent input buffers (worker/input_batch.py), and replays the graph of the
smallest captured size >= the batch: the runner fills the buffers as for an eager step, pads
the extra sequences (token 0, position 0, slot -1 so their K/V is never written, seq_len 1,
the all-zero block table row), replays, and takes the first rows of the graph's output.

Only decode-only batches (one token per sequence) no larger than the largest size replay;
prefills, mixed batches and larger batches run eagerly. Capture needs an attention backend
whose forward is graph-safe (device tensors only, no host sync, no shape-dependent host
logic beyond num_seqs / num_tokens / max_query_len / max_seq_len): the Triton backend says so
with `cuda_graph_safe = True`; the torch reference is not (it syncs to find padding slots).
Everything here runs only when the device is CUDA; on CPU the runner never builds one.
"""
from __future__ import annotations

import gc
import logging
import time
from unittest import mock

import torch
from torch import nn

from tidal.protocol.sizing import cuda_graph_capture_sizes
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.forward_context import set_forward_context
from tidal.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)


def capture_sizes(max_num_seqs: int, override: list[int] | None = None,
                  max_num_tokens: int | None = None) -> list[int]:
    """The batch sizes to capture, ascending: vLLM's grid (cuda_graph_capture_sizes) capped
    at max_num_seqs and at max_num_tokens (the token buffers' size). `override` (the engine's
    cuda_graph_sizes) replaces the grid; a size above the cap becomes the cap, as vLLM pads such
    batches to its larger size (max_cudagraph_capture_size=512 with max_num_seqs=100 captures up
    to 100, not to the grid's 96, which would leave batches of 97-100 eager)."""
    cap = max_num_seqs if max_num_tokens is None else min(max_num_seqs, max_num_tokens)
    if override is not None:
        return sorted({min(int(s), cap) for s in override if int(s) >= 1 and cap >= 1})
    return cuda_graph_capture_sizes(cap)


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest size in `sizes` (ascending) >= n, or None when n is larger than all."""
    import bisect

    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


def backend_is_graph_safe(device: torch.device) -> tuple[bool, str]:
    """Whether the attention backend the KV cache on `device` gets can be captured, and its name."""
    from tidal.worker.attention_backends import attention_backend_for

    backend = attention_backend_for(device)
    # A backend that reads only device tensors and host ints says so (the Triton one does).
    return bool(getattr(backend, "cuda_graph_safe", False)), type(backend).__name__


class CudaGraphRunner:
    """Captured decode graphs over an InputBatch's buffers, one per size."""

    def __init__(self, model: nn.Module, input_batch: InputBatch, sizes: list[int], max_model_len: int) -> None:
        self.model = model
        self.input_batch = input_batch
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.generation = -1  # the InputBatch buffers' generation the graphs read
        self.pool = None

    def padded_size(self, num_seqs: int) -> int | None:
        """The graph size a decode-only batch of num_seqs replays with, or None (eager)."""
        if not self.graphs:
            return None
        if self.generation != self.input_batch.generation:
            # The buffers were reallocated (a step beyond the sizes given): the graphs read
            # the old ones. Never happens with the scheduler's limits; run eagerly from now on.
            logger.warning("input buffers were reallocated: CUDA graphs dropped, decodes run eagerly")
            self.graphs.clear()
            return None
        return padded_size(num_seqs, self.sizes)

    def decode_metadata(self, num_seqs: int) -> AttentionMetadata:
        """Metadata of a decode batch of num_seqs over the persistent buffers (views [:n]): what
        the graph of that size is captured with. max_seq_len is max_model_len, so a kernel
        launch sized by it fits every replay."""
        ib = self.input_batch
        meta = AttentionMetadata.build(
            slot_mapping=ib.slot_mapping.dev[:num_seqs],
            query_start_loc=list(range(num_seqs + 1)),
            seq_lens=[1] * num_seqs,
            block_tables=ib.step_table[:num_seqs],
            block_size=ib.block_size,
            query_start_loc_device=ib.query_start_loc.dev[: num_seqs + 1],
            seq_lens_device=ib.seq_lens.dev[:num_seqs],
        )
        meta.max_query_len = 1
        meta.max_seq_len = self.max_model_len
        meta.block_tables_checked = True
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        ib = self.input_batch
        device = ib.device
        assert device.type == "cuda" and ib.separate
        ib.fill_dummy_decode(self.sizes[-1])
        torch.cuda.synchronize(device)
        gc.collect()
        torch.cuda.empty_cache()
        free_before = torch.cuda.mem_get_info(device)[0]
        t0 = time.perf_counter()
        self.pool = torch.cuda.graph_pool_handle()
        # torch.cuda.graph runs gc.collect and empty_cache at every capture (seconds over ~40
        # sizes); done once above instead, as vLLM does.
        with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache", lambda: None):
            for n in reversed(self.sizes):  # largest first: the smaller ones reuse its pool memory
                meta = self.decode_metadata(n)
                input_ids, positions = ib.input_ids.dev[:n], ib.positions.dev[:n]
                with set_forward_context(meta):
                    self.model(input_ids, positions)  # warm-up (lazy init, autotuning) outside capture
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                with set_forward_context(meta), torch.cuda.graph(graph, pool=self.pool):
                    hidden = self.model(input_ids, positions)
                self.graphs[n] = (graph, hidden)
        torch.cuda.synchronize(device)
        self.generation = ib.generation
        free_after = torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d CUDA graphs (decode batch sizes %d..%d) in %.2f s, using %.1f MiB",
                    len(self.graphs), self.sizes[0], self.sizes[-1], time.perf_counter() - t0,
                    (free_before - free_after) / 2**20)

    def replay(self, padded: int, num_tokens: int) -> torch.Tensor:
        """Run the graph of size `padded` over the buffers as filled; the first num_tokens
        rows of its output (valid until the next replay)."""
        graph, hidden = self.graphs[padded]
        graph.replay()
        return hidden[:num_tokens]
