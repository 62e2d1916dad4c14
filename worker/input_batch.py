"""Persistent step inputs of the model runner.

Every tensor a forward reads (token ids, positions, KV slots, block table, sequence lengths,
query start offsets, the rows that go through the LM head) lives in a buffer allocated once,
sized for max_num_seqs / max_num_batched_tokens / ceil(max_model_len / block_size); a step
fills a prefix of each. The host fills numpy views of staging memory:

- on CPU the device tensors ARE the staging memory (torch views of the same numpy arrays): no
  copy at all;
- elsewhere (CUDA) the staging memory is a pinned CPU tensor and each step copies the prefix it
  filled with `non_blocking=True`; nothing on the host waits for the device (the runner's only
  sync is reading the sampled ids). An event recorded after the copies guards the staging
  memory: the next step waits for it (normally long done) before overwriting, so a rank that
  never syncs (a non-driver TP rank) cannot overwrite a copy still in flight.

Block tables: each request owns a row of a per-request table while it is in the runner's
state (rows come from a free-list; a preempted request's row is freed with it and a resumed
one takes a new row). A row changes only when the request is added (whole row written, tail
zeroed) or gets new blocks (appended). Block ids are range-checked here, where they enter,
so the step's AttentionMetadata can say `block_tables_checked=True`. Per step the rows of the
scheduled requests are gathered in batch order into the step's block table: on CPU with one
numpy `take` into a contiguous [num_seqs, widest] buffer; on CUDA the rows changed since the
last step are uploaded (one copy + one `index_copy_` into the device-resident per-request
table) and one `index_select` on the device gathers the step's rows into a fixed-width
[max_num_seqs, max_blocks_per_seq] buffer (what a captured CUDA graph reads).

Row 0 of the per-request table is never given to a request: it stays all zeros and is the
row padding sequences of a CUDA-graph replay read (block 0, seq_len 1, slot -1).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tidal.protocol.sizing import cdiv

PAD_ROW = 0  # the per-request table's all-zero row, never owned by a request


class _Buf:
    """A device buffer and the host staging memory it is filled from (`np`, a numpy view).
    With `separate` False (CPU) both are the same memory and `upload` copies nothing."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, separate: bool) -> None:
        if separate:
            self.host = torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")
            self.dev = torch.zeros(shape, dtype=dtype, device=device)
        else:
            self.host = torch.zeros(shape, dtype=dtype)
            self.dev = self.host
        self.np = self.host.numpy()

    def upload(self, n: int) -> torch.Tensor:
        """Copy the first n rows to the device; returns the device view [:n]."""
        dev = self.dev[:n]
        if n and self.dev is not self.host:
            dev.copy_(self.host[:n], non_blocking=True)
        return dev


@dataclass
class StepInputs:
    """One step's views of the persistent buffers (length: the padded size when padded)."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64; -1 on padding tokens
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, width] int64 (CPU: width = the widest row; CUDA: max blocks)
    query_start_loc_list: list[int]  # the real sequences' (unpadded) host copies
    seq_lens_list: list[int]
    num_tokens: int  # real (unpadded)
    num_seqs: int


class InputBatch:
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, device: torch.device, num_blocks: int | None = None,
                 separate_staging: bool | None = None) -> None:
        """`separate_staging` (default: device is not the CPU) selects the staging-copy path;
        tests force it on CPU tensors to run the CUDA code path's logic."""
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks  # None until the KV cache is bound: only ids < 0 refused
        self.separate = device.type != "cpu" if separate_staging is None else separate_staging
        self.max_num_seqs = max(1, max_num_seqs)
        self.max_num_tokens = max(1, max_num_batched_tokens)
        self.max_blocks = max(1, cdiv(max_model_len, block_size))
        # Bumped whenever a buffer is reallocated (a step larger than the sizes given): views
        # taken before (a captured CUDA graph's) are stale then.
        self.generation = 0
        self.last_table_width = 1  # the CPU step table's width at the last prepare()
        # Per-request rows (host mirror everywhere; on CUDA also the device copy).
        self.row_of: dict[str, int] = {}
        self._free_rows: list[int] = []
        self._num_rows = 0  # rows handed out so far (row 0 excluded)
        self.row_blocks: list[int] = [0] * (self.max_num_seqs + 1)  # blocks held by each row
        self.table = np.zeros((self.max_num_seqs + 1, self.max_blocks), dtype=np.int64)
        self._dirty: dict[int, None] = {}  # rows changed since the last upload (ordered set)
        self._copy_done: torch.cuda.Event | None = None
        self._allocate()

    # ------------------------------------------------------------------ buffers
    def _allocate(self) -> None:
        dev, sep = self.device, self.separate
        nt, ns, mb = self.max_num_tokens, self.max_num_seqs, self.max_blocks
        self.input_ids = _Buf((nt,), torch.int64, dev, sep)
        self.positions = _Buf((nt,), torch.int64, dev, sep)
        self.slot_mapping = _Buf((nt,), torch.int64, dev, sep)
        self.query_start_loc = _Buf((ns + 1,), torch.int32, dev, sep)
        self.seq_lens = _Buf((ns,), torch.int32, dev, sep)
        # LM-head rows: every sampling row plus every prompt-logprob row.
        self.logits_index = _Buf((ns + nt,), torch.int64, dev, sep)
        if sep:
            self.table_dev = torch.zeros(self.table.shape, dtype=torch.int64, device=dev)
            self.table_dev[: self.table.shape[0]].copy_(torch.from_numpy(self.table))
            self.step_table = torch.zeros((ns, mb), dtype=torch.int64, device=dev)
            self.row_index = _Buf((ns,), torch.int64, dev, sep)
            self.dirty_rows = _Buf((ns,), torch.int64, dev, sep)
            self.dirty_vals = _Buf((ns, mb), torch.int64, dev, sep)
        else:
            # Contiguous [num_seqs, widest row] views of one flat buffer.
            self.step_table_flat = _Buf((ns * mb,), torch.int64, dev, sep)
        self._arange32 = np.arange(max(nt, ns) + 1, dtype=np.int32)
        self._arange64 = np.arange(nt, dtype=np.int64)
        self._views: dict[tuple[int, int, int], tuple[torch.Tensor, ...]] = {}  # CPU step views by shape
        self.generation += 1

    def _grow(self, *, num_tokens: int = 0, num_seqs: int = 0, num_blocks: int = 0) -> None:
        """Reallocate the step buffers for a step larger than the sizes given (never with the
        sizes the scheduler keeps to); the per-request table keeps its rows."""
        self.max_num_tokens = max(self.max_num_tokens, num_tokens)
        self.max_num_seqs = max(self.max_num_seqs, num_seqs)
        if num_blocks > self.max_blocks:
            self.max_blocks = num_blocks
            table = np.zeros((self.table.shape[0], num_blocks), dtype=np.int64)
            table[:, : self.table.shape[1]] = self.table
            self.table = table
            self._dirty.update(dict.fromkeys(range(1, self._num_rows + 1)))
        if self.separate and self._copy_done is not None:
            self._copy_done.synchronize()
        self._allocate()

    def _ensure_rows(self) -> None:
        rows = self.table.shape[0]
        if self._num_rows + 1 < rows:
            return
        new = rows * 2
        table = np.zeros((new, self.table.shape[1]), dtype=np.int64)
        table[:rows] = self.table
        self.table = table
        self.row_blocks += [0] * (new - rows)
        if self.separate:
            table_dev = torch.zeros(table.shape, dtype=torch.int64, device=self.device)
            table_dev[:rows].copy_(self.table_dev)
            self.table_dev = table_dev

    # ------------------------------------------------------------------ per-request rows
    def _check(self, block_ids: list[int]) -> None:
        if not block_ids:
            return
        nb, lo, hi = self.num_blocks, min(block_ids), max(block_ids)  # builtins beat numpy at every size
        if lo < 0 or (nb is not None and hi >= nb):
            raise ValueError(f"block id {lo if lo < 0 else hi} is outside the KV cache ({nb} blocks)")

    def add_request(self, req_id: str, block_ids: list[int]) -> int:
        """Give `req_id` a row holding `block_ids` (a request seen again replaces its row)."""
        self._check(block_ids)
        if req_id in self.row_of:
            self.remove_request(req_id)
        if self._free_rows:
            row = self._free_rows.pop()
        else:
            self._ensure_rows()
            self._num_rows += 1
            row = self._num_rows
        n = len(block_ids)
        if n > self.table.shape[1]:
            self._grow(num_blocks=n)
        line = self.table[row]
        line[:n] = block_ids
        line[n:] = 0
        self.row_blocks[row] = n
        self.row_of[req_id] = row
        if self.separate:
            self._dirty[row] = None
        return row

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        self._check(block_ids)
        n, k = self.row_blocks[row], len(block_ids)
        if n + k > self.table.shape[1]:
            self._grow(num_blocks=n + k)
        self.table[row, n: n + k] = block_ids
        self.row_blocks[row] = n + k
        if self.separate:
            self._dirty[row] = None

    def truncate_blocks(self, row: int, num_blocks: int) -> None:
        """Keep the first `num_blocks` blocks of `row` (the rest held only rejected speculative
        rows and went back to the pool)."""
        if num_blocks >= self.row_blocks[row]:
            return
        self.table[row, num_blocks: self.row_blocks[row]] = 0
        self.row_blocks[row] = num_blocks
        if self.separate:
            self._dirty[row] = None

    def remove_request(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.row_blocks[row] = 0
            self._free_rows.append(row)

    # ------------------------------------------------------------------ one step
    def prepare(self, rows: list[int], starts: list[int], num_scheduled: list[int], tokens: list[int],
                pad_to: int | None = None, decode_slots: list[int] | None = None) -> StepInputs:
        """Fill the step's buffers: sequence i computes tokens [starts[i], starts[i] +
        num_scheduled[i]) of the request in row rows[i]; `tokens` are their ids, flattened.
        `pad_to` (decode-only steps: one token per sequence) pads the batch to that many
        sequences for a CUDA-graph replay: token 0, position 0, slot -1 (never written),
        seq_len 1, the all-zero block table row. `decode_slots`: a decode-only step's slots,
        when the caller has them (the runner computes them as it walks the requests; numpy's
        per-call overhead would dominate at small batch sizes)."""
        b, num_tokens = len(rows), len(tokens)
        decode_only = num_tokens == b
        assert pad_to is None or (decode_only and pad_to >= b)
        nb, nt = pad_to or b, pad_to or num_tokens
        if nt > self.max_num_tokens or nb > self.max_num_seqs:
            self._grow(num_tokens=nt, num_seqs=nb)
        if self._copy_done is not None:
            self._copy_done.synchronize()  # the last step's copies have left the staging memory
        bs = self.block_size
        rows_np = np.array(rows, dtype=np.int64)
        starts_np = np.array(starts, dtype=np.int64)
        qsl = self.query_start_loc.np
        seq_lens = self.seq_lens.np
        positions = self.positions.np
        slots = self.slot_mapping.np
        self.input_ids.np[:num_tokens] = tokens
        if decode_only:
            positions[:b] = starts
            qsl[: b + 1] = self._arange32[: b + 1]
            qsl_list = list(range(b + 1))
            seq_lens_list = [s + 1 for s in starts]
            seq_lens[:b] = seq_lens_list
            if decode_slots is not None:
                slots[:b] = decode_slots
            else:
                slots[:b] = self.table[rows_np, starts_np // bs] * bs + starts_np % bs
        else:
            n_np = np.array(num_scheduled, dtype=np.int64)
            qsl[0] = 0
            np.cumsum(n_np, out=qsl[1: b + 1])
            seq_lens[:b] = starts_np + n_np
            # position of flat token t = t - (its sequence's first flat index) + its start
            pos = np.repeat(starts_np - qsl[:b], n_np) + self._arange64[:num_tokens]
            positions[:num_tokens] = pos
            slots[:num_tokens] = self.table[np.repeat(rows_np, n_np), pos // bs] * bs + pos % bs
            qsl_list = qsl[: b + 1].tolist()
            seq_lens_list = seq_lens[:b].tolist()
        if nb > b:
            self.input_ids.np[num_tokens:nt] = 0
            positions[num_tokens:nt] = 0
            slots[num_tokens:nt] = -1
            seq_lens[b:nb] = 1
            qsl[b + 1: nb + 1] = self._arange32[b + 1: nb + 1]
        if self.separate:
            block_table = self._gather_rows_on_device(rows_np, nb)
            out = StepInputs(
                self.input_ids.upload(nt), self.positions.upload(nt), self.slot_mapping.upload(nt),
                self.query_start_loc.upload(nb + 1), self.seq_lens.upload(nb), block_table,
                qsl_list, seq_lens_list, num_tokens, b)
            self._record_copies()
            return out
        # CPU: the step's tensors are views of the buffers just filled; made once per shape.
        width = max(map(self.row_blocks.__getitem__, rows), default=1) or 1
        self.last_table_width = width  # a CPU graph replay copies these columns (cpu_graphs.py)
        table = self.step_table_flat.np[: nb * width].reshape(nb, width)
        table[:b] = self.table[rows_np, :width]
        if nb > b:
            table[b:] = 0
        key = (nt, nb, width)
        views = self._views.get(key)
        if views is None:
            if len(self._views) > 4096:
                self._views.clear()
            views = self._views[key] = (
                self.input_ids.dev[:nt], self.positions.dev[:nt], self.slot_mapping.dev[:nt],
                self.query_start_loc.dev[: nb + 1], self.seq_lens.dev[:nb],
                self.step_table_flat.dev[: nb * width].view(nb, width))
        return StepInputs(*views, qsl_list, seq_lens_list, num_tokens, b)

    def _gather_rows_on_device(self, rows_np: np.ndarray, nb: int) -> torch.Tensor:
        """Upload the rows changed since the last step into the device table, then gather the
        step's rows (padding rows: PAD_ROW) into the fixed-width step table."""
        if self._dirty:
            dirty = np.fromiter(self._dirty, dtype=np.int64, count=len(self._dirty))
            self._dirty = {}
            k = len(dirty)
            if k > self.dirty_rows.np.shape[0]:
                self.dirty_rows = _Buf((k,), torch.int64, self.device, True)
                self.dirty_vals = _Buf((k, self.max_blocks), torch.int64, self.device, True)
            self.dirty_rows.np[:k] = dirty
            np.take(self.table, dirty, axis=0, out=self.dirty_vals.np[:k])
            self.table_dev.index_copy_(0, self.dirty_rows.upload(k), self.dirty_vals.upload(k))
        b = len(rows_np)
        idx = self.row_index.np
        idx[:b] = rows_np
        idx[b:nb] = PAD_ROW
        step = self.step_table[:nb]
        torch.index_select(self.table_dev, 0, self.row_index.upload(nb), out=step)
        return step

    def upload_logits_index(self, index: np.ndarray) -> torch.Tensor:
        n = len(index)
        if n > self.logits_index.np.shape[0]:
            self.logits_index = _Buf((n,), torch.int64, self.device, self.separate)
        self.logits_index.np[:n] = index
        out = self.logits_index.upload(n)
        self._record_copies()
        return out

    def _record_copies(self) -> None:
        if self.separate and self.device.type == "cuda":
            if self._copy_done is None:
                self._copy_done = torch.cuda.Event()
            self._copy_done.record()

    # ------------------------------------------------------------------ CUDA graphs
    def fill_dummy_decode(self, num_seqs: int) -> None:
        """Device buffers [:num_seqs] as a padded decode batch (what a CUDA graph is captured
        over: tokens 0, positions 0, slots -1, seq_len 1, qsl 0..n, block table row of zeros)."""
        self.prepare([], [], [], [], pad_to=num_seqs)
