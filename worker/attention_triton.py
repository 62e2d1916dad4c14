"""Triton attention backend (the default on CUDA): paged KV cache write + one attention kernel
family for mixed batches of prefill chunks (with or without cached context) and decodes.

Layout of the work (after vLLM's unified_attention): the batch's query tokens are cut, per
sequence, into "q blocks" of BLOCK_Q tokens; one program handles one q block x one kv head,
with rows = BLOCK_Q tokens x the query heads sharing that kv head (so GQA loads each K/V tile
once for all its query heads). Sequence i's q blocks are numbered from
query_start_loc[i] // BLOCK_Q + i, an upper bound that only grows with i, so a program finds
its sequence by binary search over query_start_loc on the device: the grid size depends on
host ints only (num_tokens, num_seqs) and needs no per-sequence host loop, which keeps a
decode batch CUDA-graph capturable. K/V are read straight from the paged cache through the
block table, one tile of positions at a time, with an online (flash) softmax in fp32.

Split-KV (flash-decoding): for decode batches with too few (sequence, kv head) programs to fill
the GPU and a long context, a third grid axis cuts each program's kv range into NUM_SPLITS
partitions; each writes its partial (max, sum, unnormalized acc) and a reduce kernel combines
them. Off CUDA the kernels only run under TRITON_INTERPRET=1 (set before this module is
imported, since triton.jit picks the interpreter when it decorates).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from tidal.worker.attention_backends import AttentionBackend
from tidal.worker.attention_metadata import AttentionMetadata

try:
    from triton.runtime.interpreter import InterpretedFunction
except ImportError:  # pragma: no cover - every triton 3.x has it
    InterpretedFunction = ()  # type: ignore[assignment,misc]

# Split-KV only pays when a long context would otherwise run on too few programs.
SPLIT_MIN_SEQ_LEN = 1024  # contexts shorter than this attend in one pass
SPLIT_MIN_PARTITION = 256  # no partition shorter than this many positions
SPLIT_MAX = 16  # partials cost NUM_SPLITS x [T, H, D] fp32; the reduce reads all of them
DEFAULT_SM_COUNT = 132  # CPU (interpreter): an H100/H200's count
# The kernels' window for full attention: longer than any context, and far enough below 2**31
# that (position - window) stays an int32.
NO_WINDOW = 1 << 30


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_co, stride_ch,
                     HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """One program per (token, kv head): copy its K and V rows to the token's cache slot,
    converting to the cache dtype. Negative slots are padding tokens and write nothing."""
    token = tl.program_id(0).to(tl.int64)  # token * stride may pass 2**31 in a long prefill
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    offs_d = tl.arange(0, HEAD_PAD)
    # (slot broadcast to a block first: the interpreter rejects block & scalar masks)
    mask = (offs_d < HEAD_DIM) & (offs_d * 0 + slot >= 0)
    k = tl.load(k_ptr + token * stride_kt + head * stride_kh + offs_d, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + head * stride_vh + offs_d, mask=mask)
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co + head * stride_ch + offs_d
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose q blocks include q_block: the last i with
    query_start_loc[i] // BLOCK_Q + i <= q_block (binary search; the key grows with i)."""
    left: tl.int32 = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        key = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if key <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


LOG2E = 1.4426950408889634  # the host's copy (a jit function reads literals only)


@triton.jit
def _tanh(x):
    """tanh from exp of a non-positive argument: no overflow for any x (libdevice's tanh is
    CUDA-only, and the interpreter must run this too)."""
    t = tl.exp(-2.0 * tl.abs(x))
    y = (1.0 - t) / (1.0 + t)
    return tl.where(x >= 0, y, -y)


# num_seqs only bounds the sequence search, window only bounds the kv range and softcap is a
# plain multiplier: specializing on them (== 1, % 16) would compile two or three copies of the
# kernel per configuration for nothing.
@triton.jit(do_not_specialize=["num_seqs", "window", "softcap"])
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, num_seqs, qk_scale, window, softcap, sinks_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch, stride_bt,
    NUM_HEADS: tl.constexpr, Q_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    """Grid (q blocks, kv heads, NUM_SPLITS). Row m of a program is token
    m // Q_PER_KV of its q block, query head kv_head * Q_PER_KV + m % Q_PER_KV. qk_scale is
    scale * log2(e): the softmax runs in base 2. With NUM_SPLITS == 1 the program writes the
    normalized output; otherwise its partial (max, sum, acc) for the reduce kernel. tl.dot
    operands are DOT_DTYPE (q's dtype, see _dot_dtype); it always accumulates in fp32.
    window: a row at position p sees positions (p - window, p]; NO_WINDOW (larger than any
    context) for full attention. Positions no row of the program sees are never loaded.
    SOFTCAP (Gemma 2's attn_logit_softcapping): qk_scale is then the plain scale, and each
    score s becomes softcap * tanh(s / softcap) (then times log2(e)) before the mask.
    HAS_SINKS (gpt-oss): sinks_ptr [NUM_HEADS] holds one logit per query head that joins the
    softmax's denominator only: added when the output is normalized (here, or in the reduce
    kernel under split-KV, since it belongs to no partition)."""
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)  # this program's q block within its sequence
    if local * BLOCK_Q >= q_len:
        return  # past the sequence's last q block (the grid is an upper bound)
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len  # positions already cached before this chunk

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_PAD)
    q_pos = local * BLOCK_Q + offs_m // Q_PER_KV  # index within the chunk
    head = kv_head * Q_PER_KV + offs_m % Q_PER_KV
    # Rows past BLOCK_Q * Q_PER_KV (Q_PER_KV not a power of two) would repeat the next block.
    row_ok = (offs_m < BLOCK_Q * Q_PER_KV) & (q_pos < q_len)
    d_ok = offs_d < HEAD_DIM
    token = (q_start + q_pos).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(DOT_DTYPE)

    # Positions [kv_start, kv_end) are visible to some row of this block (causal, and the
    # block's first row's window), then split.
    kv_end = tl.minimum(seq_len, context_len + (local + 1) * BLOCK_Q)
    kv_start = tl.maximum(context_len + local * BLOCK_Q - window + 1, 0)
    if NUM_SPLITS == 1:
        lo = kv_start
        hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end - kv_start, NUM_SPLITS), TILE_N) * TILE_N
        lo = tl.minimum(kv_start + split * per_split, kv_end)
        hi = tl.minimum(lo + per_split, kv_end)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cache_head = kv_head * stride_ch
    for start in range(lo, hi, TILE_N):
        offs_n = start + tl.arange(0, TILE_N)
        n_ok = offs_n < hi
        # Table entries past the sequence's blocks are never read (masked): only the first
        # cdiv(seq_len, BLOCK_SIZE) were validated. Those before kv_start are not either.
        block = tl.load(table + offs_n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        row_off = block * stride_cb + (offs_n % BLOCK_SIZE) * stride_co + cache_head
        k = tl.load(k_cache_ptr + row_off[None, :] + offs_d[:, None],  # [D, N]
                    mask=n_ok[None, :] & d_ok[:, None], other=0.0)
        v = tl.load(v_cache_ptr + row_off[:, None] + offs_d[None, :],  # [N, D]
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        # A half cache under fp32 compute is widened on read (the cache may differ from q).
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            s = softcap * _tanh(s / softcap) * 1.4426950408889634  # log2(e)
        row_pos = context_len + q_pos[:, None]
        visible = ((offs_n[None, :] <= row_pos) & (offs_n[None, :] > row_pos - window)
                   & n_ok[None, :] & row_ok[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing visible yet: no NaN
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        if HAS_SINKS:  # the sink as one more (valueless) position, in base 2 like the scores
            sink = tl.load(sinks_ptr + head, mask=row_ok, other=float("-inf")).to(tl.float32) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            m_fin = tl.where(m_fin > float("-inf"), m_fin, 0.0)
            alpha = tl.exp2(m_i - m_fin)
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
            acc = acc * alpha[:, None]
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials [T, H, NUM_SPLITS] (+ [HEAD_PAD]); an empty split leaves (-inf, 0, 0).
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _reduce_splits_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, out_ptr, stride_ot, stride_oh, sinks_ptr,
                          NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HAS_SINKS: tl.constexpr):
    """One program per (token, head): combine the NUM_SPLITS partial softmaxes (base 2), and
    the head's sink logit (HAS_SINKS) into the denominator."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_PAD)
    s_ok = offs_s < NUM_SPLITS
    part = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * HEAD_PAD + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    m_max = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2(e)
        m_max = tl.maximum(m_max, sink)
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
        w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
        total = tl.sum(l * w, axis=0) + tl.exp2(sink - m_max)
    else:
        m_max = tl.where(m_max > float("-inf"), m_max, 0.0)
        w = tl.exp2(m - m_max)  # empty splits (m = -inf) weigh 0
        total = tl.sum(l * w, axis=0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


_TL_DTYPES = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def _dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """tl.dot operand dtype for queries of `dtype`: the same (fp32 runs as IEEE fp32, not TF32,
    to match torch), except bf16 under the interpreter, whose bf16 tl.dot returns garbage
    (triton 3.9): there bf16 values are widened to fp32 (exact), only the products differ."""
    if dtype not in _TL_DTYPES:
        raise ValueError(f"TritonAttentionBackend: queries must be float32, float16 or bfloat16, not {dtype}")
    if dtype == torch.bfloat16 and isinstance(_attention_kernel, InterpretedFunction):
        return tl.float32
    return _TL_DTYPES[dtype]


@functools.cache
def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return DEFAULT_SM_COUNT


def _num_splits(metadata: AttentionMetadata, num_kv_heads: int, device: torch.device,
                window: int | None = None) -> int:
    """Partitions per sequence, from host ints only (so a captured graph keeps its choice):
    1 unless a decode-only batch has fewer programs than SMs and a long context (a decode
    under a sliding window reads at most `window` positions)."""
    longest = metadata.max_seq_len if window is None else min(metadata.max_seq_len, window)
    if metadata.max_query_len != 1 or longest < SPLIT_MIN_SEQ_LEN:
        return 1
    programs = metadata.num_seqs * num_kv_heads
    sms = _sm_count(device)
    if programs >= sms:
        return 1
    want = triton.cdiv(sms, programs)
    return max(1, min(SPLIT_MAX, want, longest // SPLIT_MIN_PARTITION))


def check_block_tables(metadata: AttentionMetadata, num_blocks: int) -> None:
    """Raise ValueError unless every block id a sequence reads (the first
    cdiv(seq_len, block_size) of its row) is in [0, num_blocks), and every non-negative slot is
    inside the cache. One host sync; sets metadata.block_tables_checked on success."""
    bs = metadata.block_size
    tables = metadata.block_tables[: metadata.num_seqs]
    lens = metadata.device_seq_lens().to(torch.int64)
    needed = (lens + bs - 1) // bs
    used = torch.arange(tables.shape[1], device=tables.device)[None, :] < needed[:, None]
    bad_ids = used & ((tables < 0) | (tables >= num_blocks))
    too_long = needed > tables.shape[1]
    slots = metadata.slot_mapping
    bad_slots = slots >= num_blocks * bs
    if not bool(bad_ids.any() | too_long.any() | bad_slots.any()):  # the one sync
        metadata.block_tables_checked = True
        return
    if bool(too_long.any()):
        seq = int(too_long.nonzero()[0, 0])
        raise ValueError(f"sequence {seq}: seq_len {int(lens[seq])} needs {int(needed[seq])} blocks but its "
                         f"block table row has {tables.shape[1]} (num_blocks {num_blocks})")
    if bool(bad_ids.any()):
        seq, col = (int(x) for x in bad_ids.nonzero()[0])
        raise ValueError(f"sequence {seq}: block table entry {col} is block id {int(tables[seq, col])}, "
                         f"outside the cache's num_blocks {num_blocks}")
    token = int(bad_slots.nonzero()[0, 0])
    starts = metadata.device_query_start_loc().to(torch.int64)
    seq = int(torch.searchsorted(starts, torch.tensor([token], device=starts.device), right=True)[0]) - 1
    slot = int(slots[token])
    raise ValueError(f"sequence {seq}: token {token} writes slot {slot} (block id {slot // bs}), "
                     f"outside the cache's num_blocks {num_blocks}")


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels for CUDA tensors (CPU tensors only under TRITON_INTERPRET=1).
    force_num_splits: tests force the split-KV path (or turn it off) regardless of shape."""

    # Capturable: forward reads device tensors and host ints only, and syncs only in the block
    # table check, which a graph's metadata skips (block_tables_checked set by its builder).
    cuda_graph_safe = True

    def __init__(self, force_num_splits: int | None = None) -> None:
        self.force_num_splits = force_num_splits

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        if q.device.type == "cpu" and not isinstance(_attention_kernel, InterpretedFunction):
            raise RuntimeError(
                "TritonAttentionBackend got CPU tensors: Triton runs on CPU only under the interpreter; "
                "set TRITON_INTERPRET=1 before tidal.worker.attention_triton is imported, or use "
                "TIDAL_ATTENTION_BACKEND=cpu/torch")
        num_tokens, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        if not (k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
                and k_cache.stride(3) == 1 and block_size == metadata.block_size
                and k_cache.shape[3] == head_dim and k.shape[1] == num_kv_heads
                and num_heads % num_kv_heads == 0 and metadata.slot_mapping.shape[0] >= num_tokens
                and metadata.num_tokens <= num_tokens  # the kernels index 1-D / row-major buffers:
                and metadata.slot_mapping.stride(0) == 1 and metadata.block_tables.stride(1) == 1):
            raise ValueError(f"TritonAttentionBackend: inconsistent shapes q {tuple(q.shape)} k {tuple(k.shape)} "
                             f"cache {tuple(k_cache.shape)} block_size {metadata.block_size}")
        if sinks is not None and (sinks.shape != (num_heads,) or sinks.device != q.device):
            raise ValueError(f"TritonAttentionBackend: sinks must be one value per query head ({num_heads}) "
                             f"on {q.device}, got {tuple(sinks.shape)} on {sinks.device}")
        dot_dtype = _dot_dtype(q.dtype)  # refuses other dtypes before anything is written
        if not metadata.block_tables_checked:
            check_block_tables(metadata, num_blocks)  # before anything is written or read
        head_pad = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs every dim >= 16
        q, k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (q, k, v))
        if num_tokens:
            _write_kv_kernel[(num_tokens, num_kv_heads)](
                k, v, k_cache, v_cache, metadata.slot_mapping,
                k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size)
        # Rows of tokens outside every sequence (a padded batch) are left unwritten.
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if metadata.num_seqs == 0 or metadata.num_tokens == 0:
            return out
        self._attend(q, k_cache, v_cache, out, metadata, scale, head_pad, dot_dtype, sliding_window, softcap,
                     None if sinks is None else sinks.contiguous())
        return out

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                metadata: AttentionMetadata, scale: float, head_pad: int, dot_dtype: tl.dtype,
                window: int | None, softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k_cache.shape[2]
        q_per_kv = num_heads // num_kv_heads
        # Tile shapes: chosen from ptxas resource usage for sm_90 (no spills in any dtype x head
        # size): tl.dot needs every dim >= 16; prefill chunks amortize each K/V tile over more
        # query rows (64 for half dtypes up to head_dim 128, else 32) with 8 warps. The K/V
        # tile is a gather of 64-bit addresses, hence short tiles (fp32's IEEE dot runs on FMA
        # units and holds more registers, hence 16).
        half = dot_dtype != tl.float32
        prefill = metadata.max_query_len * q_per_kv > 16
        rows = (64 if half and head_pad <= 128 else 32) if prefill else 16
        block_m = max(rows, triton.next_power_of_2(q_per_kv))
        block_q = block_m // q_per_kv
        tile_n = 32 if half else 16
        splits = self.force_num_splits or _num_splits(metadata, num_kv_heads, q.device, window)
        num_q_blocks = metadata.num_tokens // block_q + metadata.num_seqs  # upper bound, see _find_seq
        if splits > 1:
            part_m = torch.empty((metadata.num_tokens, num_heads, splits), dtype=torch.float32, device=q.device)
            part_l = torch.empty_like(part_m)
            part_acc = torch.empty((*part_m.shape, head_pad), dtype=torch.float32, device=q.device)
        else:
            part_m = part_l = part_acc = out  # unused (NUM_SPLITS == 1 never touches them)
        _attention_kernel[(num_q_blocks, num_kv_heads, splits)](
            q, k_cache, v_cache, out, part_m, part_l, part_acc,
            metadata.device_query_start_loc(), metadata.device_seq_lens(), metadata.block_tables,
            metadata.num_seqs, scale if softcap else scale * LOG2E, NO_WINDOW if window is None else window,
            float(softcap or 0.0), out if sinks is None else sinks,  # (never read without sinks)
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), metadata.block_tables.stride(0),
            NUM_HEADS=num_heads, Q_PER_KV=q_per_kv, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
            BLOCK_SIZE=k_cache.shape[1], BLOCK_M=block_m, BLOCK_Q=block_q, TILE_N=tile_n,
            NUM_SPLITS=splits, DOT_DTYPE=dot_dtype, DOT_PRECISION="ieee" if dot_dtype == tl.float32 else None,
            SOFTCAP=bool(softcap), HAS_SINKS=sinks is not None, num_warps=8 if block_m >= 32 else 4, num_stages=2)
        if splits > 1:
            _reduce_splits_kernel[(metadata.num_tokens, num_heads)](
                part_m, part_l, part_acc, out, out.stride(0), out.stride(1), out if sinks is None else sinks,
                NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad,
                NUM_SPLITS=splits, SPLITS_PAD=triton.next_power_of_2(splits), HAS_SINKS=sinks is not None)
