"""CPU "graphs": decode steps of small batches replayed as a flat list of recorded kernel calls.

At batch 1 a decode step of a small model is mostly Python: per layer about ten module calls,
each checking which kernel applies, building views and calling one C kernel through ctypes
(scripts/bench_single_stream.py measures it). The CPU has no graph capture, but tidal's CPU
forward is already a sequence of C kernels over tensors: so, as CUDA graphs do, run
`model.forward` once per batch size over the model runner's persistent buffers and record what
it does -- every C kernel call with its arguments (pointers into tensors kept alive here), and
every torch op that computes (the embedding lookup, say) -- then replay that list each step:
only the buffers' contents change.

Recording is safe only when the forward's work depends on the buffers' contents and nothing
else, so the capture refuses (and decodes stay eager) when the forward
- reads a tensor's value on the host (`.item()`, `bool(t)`, `.tolist()`, `.numpy()`),
- makes a tensor from Python data (`torch.tensor(list)`, `torch.from_numpy`), or
- runs under tensor parallelism (collectives are not recorded), or
- uses another attention backend than the C-kernel one (TIDAL_ATTENTION_BACKEND=torch/triton).
Python control flow decided by shapes is fixed per captured size, exactly as in a CUDA graph.
Every size is then checked: a replay over inputs other than the capture's (random token ids
and positions, ragged context lengths) must equal an eager forward over the same inputs, or
the graphs are dropped -- a kernel reached some other way than through `cpu_kernels()` would
show up there, not in a user's output.

Padding, as for CUDA graphs: a batch replays with the smallest captured size >= its size; the
extra rows are token 0, position 0, slot -1 (never written), seq_len 1, a zero block-table row.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from tidal.worker.attention_cpu import PagedDecodeBatch
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.cpu_kernels import cpu_kernels
from tidal.worker.forward_context import set_forward_context
from tidal.worker.input_batch import InputBatch

logger = logging.getLogger(__name__)

DEFAULT_SIZES = (1, 2, 4)  # where per-step Python dominates; larger batches amortize it
_ALLOCATIONS = {torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty,
                torch.Tensor.new_empty_strided}  # contents undefined: nothing to replay
_HOST_READ = "reads a tensor's value on the host (.item(), float(t), bool(t), .tolist())"
_FROM_PYTHON = "makes a tensor from Python data (torch.tensor, from_numpy)"
_REFUSED = {**{f: _HOST_READ for f in (torch.Tensor.item, torch.Tensor.__bool__, torch.Tensor.__float__,
                                       torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.tolist,
                                       torch.Tensor.numpy, torch.equal, torch.Tensor.equal)},
            **{f: _FROM_PYTHON for f in (torch.tensor, torch.as_tensor, torch.from_numpy, torch.asarray)}}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__iand__", "__ior__"}


class CaptureRefused(RuntimeError):
    """The forward does something a recording cannot replay; decodes stay eager."""


class _KernelCall:
    __slots__ = ("fn", "args", "name")

    def __init__(self, fn: Any, args: tuple[Any, ...], name: str) -> None:
        self.fn, self.args, self.name = fn, args, name

    def run(self) -> None:
        rc = self.fn(*self.args)
        if rc:  # every int-returning kernel returns 0 on success
            raise RuntimeError(f"CPU graph replay: kernel {self.name} returned {rc}")


class _TorchCall:
    """A computing torch call: replayed, its fresh outputs (result index, captured tensor)
    copied into the captured ones later calls read; an in-place or out= call just runs again."""

    __slots__ = ("func", "args", "kwargs", "outs")

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
                 outs: list[tuple[int, torch.Tensor]]) -> None:
        self.func, self.args, self.kwargs, self.outs = func, args, kwargs, outs

    def run(self) -> None:
        result = self.func(*self.args, **self.kwargs)
        if self.outs:
            fresh = result if isinstance(result, (tuple, list)) else (result,)
            for i, dst in self.outs:
                dst.copy_(fresh[i])


def _storages(args: Any) -> set[int]:
    found: set[int] = set()
    for a in args:
        if isinstance(a, torch.Tensor):
            found.add(a.untyped_storage().data_ptr())
        elif isinstance(a, (tuple, list)):
            found |= _storages(a)
    return found


class _Recorder(TorchFunctionMode):
    """Records a forward's top-level torch calls (the mode is off inside each call). A function
    mode, not a dispatch mode: entering one of those imports torch._dynamo (seconds)."""

    def __init__(self, plan: list[Any]) -> None:
        super().__init__()
        self.plan = plan
        self.keep: list[Any] = []  # every tensor made during the capture lives as long as the plan

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _REFUSED:
            raise CaptureRefused(f"the forward {_REFUSED[func]} ({getattr(func, '__name__', func)})")
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__")) \
                or kwargs.get("out") is not None:
            self.keep.append((args, kwargs, result))
            self.plan.append(_TorchCall(func, args, kwargs, []))
            return result
        results = result if isinstance(result, (tuple, list)) else (result,)
        if not results or not all(isinstance(t, torch.Tensor) for t in results) or func in _ALLOCATIONS:
            self.keep.append(result)
            return result  # a query (shape, stride, data_ptr) or an allocation
        self.keep.append((args, kwargs, result))
        inputs = _storages(args) | _storages(kwargs.values())
        outs = [(i, t) for i, t in enumerate(results) if t.untyped_storage().data_ptr() not in inputs]
        if outs:  # else views of memory the plan already owns (to() / reshape() may copy)
            self.plan.append(_TorchCall(func, args, kwargs, outs))
        return result


@contextlib.contextmanager
def _recording_kernels(plan: list[Any]) -> Iterator[None]:
    """Every C kernel called through cpu_kernels() while inside is run and recorded."""
    lib = cpu_kernels()
    if lib is None:
        raise CaptureRefused("the CPU kernels are not built")
    originals = {name: fn for name, fn in vars(lib).items() if isinstance(fn, ctypes._CFuncPtr)}

    def recorder(name: str, fn: Any) -> Any:
        def call(*args: Any) -> Any:
            plan.append(_KernelCall(fn, args, name))
            return fn(*args)
        return call

    try:
        for name, fn in originals.items():
            setattr(lib, name, recorder(name, fn))
        yield
    finally:
        for name, fn in originals.items():
            setattr(lib, name, fn)


class CpuGraphRunner:
    """Recorded decode steps over an InputBatch's buffers, one per batch size."""

    def __init__(self, model: nn.Module, input_batch: InputBatch, sizes: list[int], max_model_len: int) -> None:
        self.model = model
        self.max_model_len = max_model_len
        self.input_batch = input_batch
        self.sizes = sorted(sizes)
        self.graphs: dict[int, tuple[list[Any], torch.Tensor, _Recorder]] = {}
        self.generation = -1
        n, mb = self.sizes[-1], input_batch.max_blocks
        # The attention kernel's view of a decode batch, static: rows 0..n-1, int64 lengths,
        # a full-width table (a step fills the columns it uses).
        self.rows = torch.arange(n, dtype=torch.int64)
        self.seq_lens = torch.ones(n, dtype=torch.int64)
        self.table = torch.zeros((n, mb), dtype=torch.int64)
        self.replays = 0

    def padded_size(self, num_seqs: int) -> int | None:
        if not self.graphs:
            return None
        if self.generation != self.input_batch.generation:
            logger.warning("input buffers were reallocated: CPU graphs dropped, decodes run eagerly")
            self.graphs.clear()
            return None
        for size in self.sizes:
            if size >= num_seqs:
                return size if size in self.graphs else None
        return None

    def _metadata(self, n: int, seq_lens: list[int]) -> AttentionMetadata:
        ib = self.input_batch
        meta = AttentionMetadata.build(
            slot_mapping=ib.slot_mapping.dev[:n], query_start_loc=list(range(n + 1)), seq_lens=seq_lens,
            block_tables=self.table[:n], block_size=ib.block_size,
            query_start_loc_device=ib.query_start_loc.dev[: n + 1], seq_lens_device=ib.seq_lens.dev[:n])
        meta.block_tables_checked = True
        meta.__dict__["paged_decode"] = PagedDecodeBatch(self.rows[:n], self.seq_lens[:n], self.table[:n])
        return meta

    @torch.inference_mode()
    def capture(self) -> None:
        ib = self.input_batch
        t0 = time.perf_counter()
        generation = ib.generation
        for n in self.sizes:
            ib.fill_dummy_decode(n)
            if ib.generation != generation:  # the sizes captured so far read the old buffers
                raise CaptureRefused(f"batch size {n} does not fit the step buffers (they were reallocated)")
            self.seq_lens[:n] = 1
            self.table[:n] = 0
            plan: list[Any] = []
            recorder = _Recorder(plan)
            meta = self._metadata(n, [1] * n)
            with set_forward_context(meta), _recording_kernels(plan), recorder:
                hidden = self.model(ib.input_ids.dev[:n], ib.positions.dev[:n])
            self.graphs[n] = (plan, hidden, recorder)
            self._check(n)
        self.generation = ib.generation
        logger.info("captured CPU graphs for decode batch sizes %s in %.2f s (%s kernel calls at batch 1)",
                    self.sizes, time.perf_counter() - t0, len(self.graphs[self.sizes[0]][0]))

    def _check(self, n: int) -> None:
        """A replay over fresh inputs equals an eager forward over them (bitwise, the same
        kernels run in the same order), else CaptureRefused."""
        ib = self.input_batch
        gen = np.random.default_rng(n)
        vocab = self._vocab_size()
        # ragged context lengths over up to three blocks (as many as a row can hold)
        longest = min(ib.block_size * min(3, ib.max_blocks), self.max_model_len)
        lens = [int(x) for x in gen.integers(1, longest + 1, size=n)]
        ib.input_ids.np[:n] = gen.integers(0, vocab, size=n)
        ib.positions.np[:n] = [length - 1 for length in lens]
        ib.slot_mapping.np[:n] = -1  # nothing written: both runs read the same cache
        ib.seq_lens.np[:n] = lens
        width = -(-max(lens) // ib.block_size)
        self.table[:n, :width] = torch.arange(width)[None, :] % max(1, ib.num_blocks or 1)
        self.seq_lens[:n] = torch.tensor(lens)
        with set_forward_context(self._metadata(n, lens)):
            eager = self.model(ib.input_ids.dev[:n], ib.positions.dev[:n]).clone()
        replayed = self._run(n).clone()
        if not torch.equal(eager, replayed):
            diff = (eager - replayed).abs().max().item()
            raise CaptureRefused(f"a replay at batch size {n} differs from the eager forward (max |diff| {diff:.3g}): "
                                 "the forward does work the recording does not see")

    def _vocab_size(self) -> int:
        emb = getattr(getattr(self.model, "model", None), "embed_tokens", None)
        weight = getattr(emb, "weight", None)
        return int(weight.shape[0]) if weight is not None else 1

    def _run(self, n: int) -> torch.Tensor:
        plan, hidden, _ = self.graphs[n]
        for call in plan:
            call.run()
        return hidden

    def replay(self, padded: int, num_tokens: int) -> torch.Tensor:
        """The buffers as the step filled them (InputBatch.prepare with pad_to=padded) -> the
        first num_tokens rows of the hidden states (valid until the next replay)."""
        ib = self.input_batch
        width = ib.last_table_width
        self.seq_lens.numpy()[:padded] = ib.seq_lens.np[:padded]
        self.table.numpy()[:padded, :width] = ib.step_table_flat.np[: padded * width].reshape(padded, width)
        self.replays += 1
        return self._run(padded)[:num_tokens]


def capture_cpu_graphs(model: nn.Module, input_batch: InputBatch, max_num_seqs: int, max_model_len: int,
                       sizes: tuple[int, ...] = DEFAULT_SIZES) -> CpuGraphRunner | None:
    """The runner, or None (logged) when the model's forward cannot be recorded."""
    usable = [s for s in sizes if s <= min(max_num_seqs, input_batch.max_num_tokens)]
    if not usable:
        return None
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        logger.info("CPU graphs: not captured under tensor parallelism; decodes run eagerly")
        return None
    from tidal.worker.attention_backends import attention_backend_for
    from tidal.worker.attention_cpu import CpuAttentionBackend

    backend = attention_backend_for(input_batch.device)
    if type(backend) is not CpuAttentionBackend:  # the recorded attention is its C kernel
        logger.info("CPU graphs: not captured (attention backend %s); decodes run eagerly", type(backend).__name__)
        return None
    runner = CpuGraphRunner(model, input_batch, usable, max_model_len)
    try:
        runner.capture()
    except CaptureRefused as e:
        logger.info("CPU graphs: not captured (%s); decodes run eagerly", e)
        return None
    except Exception as e:  # noqa: BLE001 - e.g. an opaque (oneDNN-packed) tensor: serve eagerly
        logger.warning("CPU graphs: capture failed (%s: %s); decodes run eagerly", type(e).__name__, e)
        return None
    return runner
