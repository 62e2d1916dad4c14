"""CPU attention backend: decodes read the paged KV cache directly in a C kernel, and so do
short multi-row sequences (a speculative verification's 1 + k rows), one kernel row per query
row (`AttentionMetadata.short_seqs` / `paged_rows`).

Prefill chunks keep torch's SDPA (`TorchAttentionBackend`): they are GEMM-shaped and SDPA's
flash kernel handles them well. Decodes are where the torch path loses: it must gather each
sequence's blocks into a padded tensor (a copy of the whole context, every layer, every step)
before SDPA can run, and SDPA's CPU kernel is slow for one query row. The kernel in
csrc/paged_attention.c walks the block tables instead (`python scripts/bench_cpu_kernels.py` measures both).
Both paths honour a sliding window, a logit soft cap and attention sinks (gpt-oss; the kernel
takes all three as arguments).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.attention_torch import TorchAttentionBackend
from tidal.worker.cpu_kernels import cpu_kernels, is_f32_cpu, ptr

# Cache dtype -> suffix of the kernels reading / writing it. K/V and queries are float32 in
# every case: a half cache holds float32 activations rounded to nearest even on write.
_CACHE_KERNEL_SUFFIX = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


@dataclass
class PagedDecodeBatch:
    """The rows a kernel reading the paged cache directly attends, each as a decode
    (contiguous int64): row i is query token rows[i], attending positions [0, seq_lens[i]) of
    the sequence whose block table row is block_tables[i]."""

    rows: torch.Tensor  # [n] token index of each kernel row in the flat batch
    seq_lens: torch.Tensor  # [n] context length including the row's own token
    block_tables: torch.Tensor  # [n, max_blocks]

    @classmethod
    def build(cls, meta: AttentionMetadata, multi_row: Sequence[int] = ()) -> "PagedDecodeBatch":
        """The decodes, then one row per query token of each sequence in `multi_row` (row j of
        a sequence with q query rows: context seq_len - q + 1 + j, its table row repeated)."""
        seqs = meta.decode_seqs
        device = meta.block_tables.device
        qsl, seq_lens = meta.query_start_loc, meta.seq_lens
        rows = [qsl[i] for i in seqs]
        lens = [seq_lens[i] for i in seqs]
        table_rows = list(seqs)
        for i in multi_row:
            start, end, n = qsl[i], qsl[i + 1], seq_lens[i]
            rows.extend(range(start, end))
            lens.extend(range(n - (end - start) + 1, n + 1))
            table_rows.extend([i] * (end - start))
        if table_rows == list(range(meta.block_tables.shape[0])):
            tables = meta.block_tables
        else:
            tables = meta.block_tables.index_select(0, torch.tensor(table_rows, dtype=torch.long, device=device))
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        lens_t = torch.tensor(lens, dtype=torch.long, device=device)
        return cls(rows_t, lens_t, tables.to(torch.long).contiguous())


def _cache_kernel(prefix: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Any | None:
    """The kernel `prefix + suffix` for these caches (same dtype, float32 or half, CPU), else None."""
    suffix = _CACHE_KERNEL_SUFFIX.get(k_cache.dtype)
    if suffix is None or v_cache.dtype != k_cache.dtype or k_cache.device.type != "cpu":
        return None
    lib = cpu_kernels()
    return None if lib is None else getattr(lib, prefix + suffix)


class CpuAttentionBackend(TorchAttentionBackend):
    """Falls back to the torch path for anything the kernels do not cover (caches other than
    float32/fp16/bf16, non-float32 activations, non-CPU tensors, or no C compiler)."""

    def supports(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        return self._decode_kernel(q, k_cache, v_cache) is not None

    @staticmethod
    def _decode_kernel(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Any | None:
        """The paged decode kernel for these tensors, or None when it does not apply."""
        if not (
            k_cache.shape == v_cache.shape and k_cache.is_contiguous() and v_cache.is_contiguous()
            and q.shape[1] % k_cache.shape[2] == 0 and q.shape[2] == k_cache.shape[3]
            and is_f32_cpu(q)  # builds the kernels on first use
        ):
            return None
        return _cache_kernel("tidal_paged_decode_attention_swcap_", k_cache, v_cache)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                     metadata: AttentionMetadata) -> None:
        """One C call copies every token's K and V row to its slot (padding slots < 0 skipped),
        instead of two index_copy_ calls and, for padded batches, three index_selects."""
        slots = metadata.slot_mapping
        row = flat_k.shape[1] * flat_k.shape[2]
        if not (
            k.shape == v.shape and k.shape[1:] == flat_k.shape[1:] and flat_k.shape == flat_v.shape
            and k.stride(2) == 1 and k.stride(1) == k.shape[2] and v.stride(2) == 1 and v.stride(1) == v.shape[2]
            and flat_k.is_contiguous() and flat_v.is_contiguous()
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (k.shape[0],)
            and slots.device.type == "cpu" and is_f32_cpu(k, v)
            and (write := _cache_kernel("tidal_write_kv_cache_", flat_k, flat_v)) is not None
        ):
            return super()._write_cache(k, v, flat_k, flat_v, metadata)
        rc = write(
            ptr(k), k.stride(0), ptr(v), v.stride(0), ptr(slots), k.shape[0], ptr(flat_k), ptr(flat_v),
            flat_k.shape[0], row)
        if rc != 0:
            raise RuntimeError(f"KV cache write: a slot is outside the {flat_k.shape[0]}-slot cache")

    def _paged_kernel(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      sinks: torch.Tensor | None) -> Any | None:
        """The paged decode kernel for this call (the sink variant with sinks), or None when it
        does not apply (the torch path then)."""
        kernel = self._decode_kernel(q, k_cache, v_cache)
        if sinks is not None and kernel is not None:  # sinks it cannot read take the torch path
            ok = sinks.shape == (q.shape[1],) and sinks.is_contiguous() and is_f32_cpu(sinks)
            kernel = _cache_kernel("tidal_paged_decode_attention_sink_", k_cache, v_cache) if ok else None
        return kernel

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """As the torch path, except that short multi-row sequences (`metadata.short_seqs`: a
        speculative verification's 1 + k rows) join the decodes in the kernel, one kernel row
        per query row (`metadata.paged_rows`), instead of a gather and an SDPA call each."""
        if not metadata.short_seqs or (kernel := self._paged_kernel(q, k_cache, v_cache, sinks)) is None:
            return super().forward(q, k, v, k_cache, v_cache, metadata, scale, sliding_window, softcap, sinks)
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        self._write_cache(k, v, flat_k, flat_v, metadata)  # before any row reads the cache
        out = q.new_empty(q.shape)
        self._run_kernel(kernel, q, k_cache, v_cache, metadata.paged_rows, scale, out, sliding_window, softcap, sinks)
        for span in metadata.prefill_spans(sliding_window, paged_rows=True):
            self._prefill(q, k, v, flat_k, flat_v, span, scale, out, softcap, sinks)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        kernel = self._paged_kernel(q, k_cache, v_cache, sinks)
        if kernel is None or out.shape != q.shape or not out.is_contiguous():
            return super()._decode(q, k_cache, v_cache, metadata, scale, out, window, softcap, sinks)
        return self._run_kernel(kernel, q, k_cache, v_cache, metadata.paged_decode, scale, out, window, softcap, sinks)

    @staticmethod
    def _run_kernel(kernel: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    batch: PagedDecodeBatch, scale: float, out: torch.Tensor, window: int | None,
                    softcap: float | None, sinks: torch.Tensor | None) -> torch.Tensor:
        """Fills out's rows batch.rows (out: q's shape, contiguous) and returns out."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        if q.stride(2) != 1 or q.stride(1) != head_dim:
            q = q.contiguous()  # the kernel reads each row's heads back to back
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        rc = kernel(
            ptr(q), q.stride(0), ptr(out), out.stride(0), ptr(batch.rows), min(q.shape[0], out.shape[0]),
            ptr(k_cache), ptr(v_cache), num_blocks, ptr(batch.block_tables), batch.block_tables.shape[1],
            ptr(batch.seq_lens), batch.rows.shape[0], num_heads, num_kv_heads, head_dim,
            block_size, scale, window or 0, softcap or 0.0, *(() if sinks is None else (ptr(sinks),)),
        )
        if rc == -1:
            raise MemoryError("paged decode attention: could not allocate per-thread scratch")
        if rc != 0:
            raise RuntimeError(
                f"paged decode attention: a query row or block table entry is out of range "
                f"({q.shape[0]} rows, {num_blocks}-block cache)")
        return out
