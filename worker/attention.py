"""Attention over a paged KV cache, and the forward context that carries its metadata.

The model runner builds one `AttentionMetadata` per step, enters `set_forward_context(meta)`
around `model.forward`, and every `Attention` layer reads it from `get_forward_context()`.
Everything that depends only on the batch layout (which tokens decode, which cache slots to
gather, masks) is computed once in `AttentionMetadata.build`, not once per layer.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal.protocol import envs
from tidal.protocol.utils import cdiv


@dataclass
class PrefillSpan:
    """One sequence with query_len > 1 (a prompt or a chunk of one)."""

    q_start: int
    q_end: int
    seq_len: int  # context length including this chunk
    # Flat cache slots of positions [0, seq_len) when earlier context is cached; None when the
    # chunk is the whole context, so attention runs on the new K/V without touching the cache.
    kv_slots: torch.Tensor | None = None
    # [q_len, seq_len] bool, True = may attend; None means plain causal (no cached context).
    mask: torch.Tensor | None = None


# Bound on (decodes in a group) x (longest context in it): the padded K/V gathered for one SDPA
# call. 32K tokens is ~128 MiB per tensor at 8 kv heads x 128 dims in float32.
DECODE_GATHER_MAX_TOKENS = 32768


@dataclass
class DecodeGroup:
    """Decodes (query_len == 1) attended together in one SDPA call."""

    num: int
    token_start: int  # their tokens are [token_start, token_start + num) when token_indices is None
    token_indices: torch.Tensor | None
    gather_len: int  # blocks gathered per sequence x block_size (>= the longest context)
    # [num * blocks_per_seq] cache block ids, gathered whole: copying 16-token rows is ~2x faster
    # than gathering single slots. Entries past a sequence's own blocks repeat its first gathered
    # block (a written block, so never uninitialized memory) and are masked out.
    kv_blocks: torch.Tensor
    mask: torch.Tensor | None  # [num, 1, 1, gather_len] bool; None when every position is valid

    @classmethod
    def build(
        cls,
        seqs: list[int],
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        window: int | None = None,
    ) -> "DecodeGroup":
        """window: the layer's sliding window; only the blocks holding a sequence's last
        `window` positions are gathered (earlier ones may be freed and reused by then)."""
        device = block_tables.device
        token_idx = [query_start_loc[i] for i in seqs]
        start = token_idx[0]
        contiguous = token_idx == list(range(start, start + len(seqs)))
        indices = None if contiguous else torch.tensor(token_idx, dtype=torch.long, device=device)
        lens_list = [seq_lens[i] for i in seqs]
        first_list = [window_start(n, window) // block_size for n in lens_list]
        num_blocks = max(cdiv(n, block_size) - f for n, f in zip(lens_list, first_list))
        gather_len = num_blocks * block_size
        lens = torch.tensor(lens_list, dtype=torch.long, device=device)
        rows = torch.tensor(seqs, dtype=torch.long, device=device)
        table = block_tables.index_select(0, rows)
        cols = torch.arange(num_blocks, device=device)[None, :]
        if any(first_list):
            cols = cols + torch.tensor(first_list, dtype=torch.long, device=device)[:, None]
            table = table.gather(1, cols.clamp(max=table.shape[1] - 1))
        else:
            table = table[:, :num_blocks]
        owned = cols < ((lens + block_size - 1) // block_size)[:, None]
        table = torch.where(owned, table, table[:, :1])
        mask = None
        if window is None and min(lens_list) != gather_len:
            valid = torch.arange(gather_len, device=device)[None, :] < lens[:, None]
            mask = valid[:, None, None, :]
        elif window is not None:
            pos = cols[:, :1] * block_size + torch.arange(gather_len, device=device)[None, :]
            valid = (pos < lens[:, None]) & (pos > lens[:, None] - 1 - window)
            mask = None if bool(valid.all()) else valid[:, None, None, :]
        return cls(len(seqs), start, indices, gather_len, table.reshape(-1), mask)


def window_start(seq_len: int, window: int | None) -> int:
    """The first position a sequence's last query (at seq_len - 1) attends under `window`."""
    return 0 if window is None else max(0, seq_len - window)


@dataclass
class AttentionMetadata:
    # The batch is flattened: sequence i owns tokens query_start_loc[i]:query_start_loc[i+1].
    # Sequences may be prefill chunks (query_len > 1, possibly with earlier context cached) or
    # decodes (query_len == 1), mixed in one batch in any order.
    slot_mapping: torch.Tensor  # [T] int64 flat slot (block_id * block_size + offset) per new token
    query_start_loc: list[int]  # [B+1]
    seq_lens: list[int]  # [B] context length of each seq INCLUDING this step's tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    block_size: int
    # ---- derived by build() ----
    decode_seqs: list[int] = field(default_factory=list)  # batch indices with query_len == 1
    max_query_len: int = 0
    max_seq_len: int = 0
    # Device copies of query_start_loc / seq_lens for kernels that read them on the device
    # (int32). A builder that keeps persistent device buffers passes views of them; otherwise
    # they are made from the lists on first use.
    query_start_loc_device: torch.Tensor | None = None
    seq_lens_device: torch.Tensor | None = None
    # True once every block id a sequence reads (positions < seq_len) is known to lie inside
    # the cache: set by a builder that checked them on the host, or by the first backend call
    # that checked them, so a step pays for the check once, not once per layer.
    block_tables_checked: bool = False
    # Per-window views (prefill spans, decode groups), built on first use by the first layer
    # of each window and shared by the rest.
    _window_views: dict[tuple[str, int | None], Any] = field(default_factory=dict, init=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_decodes(self) -> int:
        return len(self.decode_seqs)

    @classmethod
    def build(
        cls,
        slot_mapping: torch.Tensor,
        query_start_loc: list[int],
        seq_lens: list[int],
        block_tables: torch.Tensor,
        block_size: int,
        query_start_loc_device: torch.Tensor | None = None,
        seq_lens_device: torch.Tensor | None = None,
    ) -> "AttentionMetadata":
        num_seqs = len(seq_lens)
        if len(query_start_loc) != num_seqs + 1:
            raise ValueError("query_start_loc must have len(seq_lens) + 1 entries")
        query_lens = [query_start_loc[i + 1] - query_start_loc[i] for i in range(num_seqs)]
        for i in range(num_seqs):
            if seq_lens[i] < query_lens[i]:
                raise ValueError(f"seq {i}: seq_len {seq_lens[i]} < query_len {query_lens[i]}")
        meta = cls(slot_mapping, list(query_start_loc), list(seq_lens), block_tables, block_size,
                   query_start_loc_device=query_start_loc_device, seq_lens_device=seq_lens_device)
        meta.decode_seqs = [i for i in range(num_seqs) if query_lens[i] == 1]
        meta.max_query_len = max(query_lens, default=0)
        meta.max_seq_len = max(seq_lens, default=0)
        return meta

    @property
    def prefills(self) -> list[PrefillSpan]:
        """The full-attention layers' prefill_spans."""
        return self.prefill_spans(None)

    def prefill_spans(self, window: int | None) -> list[PrefillSpan]:
        """The sequences with query_len > 1, with what a per-sequence SDPA needs (cache slots
        and mask when earlier context is cached, or when a sliding window cuts into the chunk)
        for layers of this window. Built on first use: kernels that read the paged cache
        directly never need it."""
        key = ("prefills", window)
        if key not in self._window_views:
            self._window_views[key] = self._build_prefill_spans(window)
        return self._window_views[key]

    def _build_prefill_spans(self, window: int | None) -> list[PrefillSpan]:
        device = self.block_tables.device
        bs = self.block_size
        spans: list[PrefillSpan] = []
        for i in range(self.num_seqs):
            start, end, seq_len = self.query_start_loc[i], self.query_start_loc[i + 1], self.seq_lens[i]
            q_len = end - start
            if q_len <= 1:
                continue
            span = PrefillSpan(start, end, seq_len)
            context = seq_len - q_len
            if context > 0:  # earlier context lives in the cache
                # The chunk's first query (at `context`) reads back to window_start of it + 1.
                pos = torch.arange(window_start(context + 1, window), seq_len, device=device)
                span.kv_slots = self.block_tables[i, pos // bs] * bs + pos % bs
                q_pos = torch.arange(context, seq_len, device=device)
                span.mask = _visible(q_pos, pos, window)
            elif window is not None and q_len > window:  # causal alone would see too far back
                pos = torch.arange(q_len, device=device)
                span.mask = _visible(pos, pos, window)
            spans.append(span)
        return spans

    def device_query_start_loc(self) -> torch.Tensor:
        """[B+1] int32 on the cache's device."""
        if self.query_start_loc_device is None:
            self.query_start_loc_device = torch.tensor(self.query_start_loc, dtype=torch.int32,
                                                       device=self.block_tables.device)
        return self.query_start_loc_device

    def device_seq_lens(self) -> torch.Tensor:
        """[B] int32 on the cache's device."""
        if self.seq_lens_device is None:
            self.seq_lens_device = torch.tensor(self.seq_lens, dtype=torch.int32, device=self.block_tables.device)
        return self.seq_lens_device

    # Per-backend views, built on first use and shared by every layer of the step (a backend
    # that does not need one never pays for it).
    @functools.cached_property
    def write_token_indices(self) -> torch.Tensor | None:
        """Tokens whose slot is >= 0 (negative slots mark padding tokens that must not be
        cached); None when every token is written. One host sync per step, not per layer."""
        slots = self.slot_mapping
        if slots.numel() and bool((slots < 0).any()):
            return torch.nonzero(slots >= 0).flatten()
        return None

    @property
    def decode_groups(self) -> list[DecodeGroup]:
        """The full-attention layers' decode_groups_for."""
        return self.decode_groups_for(None)

    def decode_groups_for(self, window: int | None) -> list[DecodeGroup]:
        """Decodes in batch order, cut into groups whose padded gather stays bounded, for
        layers of this window."""
        key = ("decode_groups", window)
        if key in self._window_views:
            return self._window_views[key]
        groups: list[DecodeGroup] = []
        group: list[int] = []
        group_max = 0
        args = (self.query_start_loc, self.seq_lens, self.block_tables, self.block_size, window)
        for i in self.decode_seqs:
            # What one sequence gathers: its context, or under a window about one window.
            span = self.seq_lens[i] if window is None else min(self.seq_lens[i], window + self.block_size)
            new_max = max(group_max, span)
            if group and new_max * (len(group) + 1) > DECODE_GATHER_MAX_TOKENS:
                groups.append(DecodeGroup.build(group, *args))
                group, new_max = [], span
            group.append(i)
            group_max = new_max
        if group:
            groups.append(DecodeGroup.build(group, *args))
        self._window_views[key] = groups
        return groups

    @functools.cached_property
    def paged_decode(self) -> "PagedDecodeBatch":  # noqa: F821 - the C-kernel backend's view
        from tidal.worker.attention_cpu import PagedDecodeBatch

        return PagedDecodeBatch.build(self)


_forward_context: AttentionMetadata | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = attn_metadata
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> AttentionMetadata | None:
    return _forward_context


def _visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: key position j is visible to query position i (causal,
    and i - window < j under a sliding window)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return visible


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[KVH, L, D] -> [KVH*groups, L, D]; on CPU this is faster than SDPA's enable_gqa path."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """Plain causal attention over one sequence: q [T, H, D], k/v [T, KVH, D] -> [T, H, D],
    limited to the last `window` positions when given."""
    mask = None
    if window is not None and q.shape[0] > window:
        pos = torch.arange(q.shape[0], device=q.device)
        mask = _visible(pos, pos, window)
    return _sdpa_one_sequence(q, k, v, scale, mask=mask)


def _sdpa_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None
) -> torch.Tensor:
    """q [T, H, D] over k/v [S, KVH, D] -> [T, H, D]; causal when mask is None, else mask
    [T, S] (True = may attend). Inputs go in as 4-D: for 3-D ones CPU SDPA takes its math path,
    measured 1.5x slower than the flash kernel it picks for 4-D."""
    groups = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        _expand_kv(k.transpose(0, 1), groups).unsqueeze(0),
        _expand_kv(v.transpose(0, 1), groups).unsqueeze(0),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
    )
    return out[0].transpose(0, 1)


class AttentionBackend(ABC):
    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Write k/v into the caches at metadata.slot_mapping, then attend: each query at
        position i over its sequence's positions (i - sliding_window, i] (all of [0, i] when
        None). Positions before a sliding window are never read: their blocks may be freed."""


class TorchAttentionBackend(AttentionBackend):
    """Reference backend on any device using torch SDPA.

    Decodes share one SDPA call (per bounded group): their contexts are gathered from the cache
    into one padded [B, KVH, L, D] tensor, and the query heads of each kv group become query rows
    ([B, KVH, H/KVH, D]), so GQA needs no K/V expansion. Only prefill chunks are looped over.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        self._write_cache(k, v, flat_k, flat_v, metadata)
        out = q.new_empty(q.shape)
        if metadata.decode_seqs:
            out = self._decode(q, k_cache, v_cache, metadata, scale, out, sliding_window)
        for span in metadata.prefill_spans(sliding_window):
            self._prefill(q, k, v, flat_k, flat_v, span, scale, out)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None) -> torch.Tensor:
        """Attention of every decode token; fills its rows of out and returns out (or, for a
        pure-decode batch, may return a new tensor instead)."""
        num_tokens, num_heads = q.shape[0], q.shape[1]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        q_per_kv = num_heads // num_kv_heads
        for group in metadata.decode_groups_for(window):
            n, length, idx = group.num, group.gather_len, group.token_indices
            q_dec = q[group.token_start : group.token_start + n] if idx is None else q.index_select(0, idx)
            # .to: a half cache under float32 compute (a no-op when the dtypes match)
            k_dec = k_cache.index_select(0, group.kv_blocks).view(n, length, num_kv_heads, head_dim).to(q.dtype)
            v_dec = v_cache.index_select(0, group.kv_blocks).view(n, length, num_kv_heads, head_dim).to(q.dtype)
            o_dec = F.scaled_dot_product_attention(
                q_dec.view(n, num_kv_heads, q_per_kv, head_dim),
                k_dec.transpose(1, 2),
                v_dec.transpose(1, 2),
                attn_mask=group.mask,
                scale=scale,
            ).reshape(n, num_heads, head_dim)
            if n == num_tokens:
                return o_dec  # pure decode batch: nothing to scatter
            if idx is None:
                out[group.token_start : group.token_start + n] = o_dec
            else:
                out.index_copy_(0, idx, o_dec)
        return out

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                 span: PrefillSpan, scale: float, out: torch.Tensor) -> None:
        s, e = span.q_start, span.q_end
        if span.kv_slots is None:
            k_i, v_i = k[s:e], v[s:e]
        else:
            k_i = flat_k.index_select(0, span.kv_slots).to(q.dtype)
            v_i = flat_v.index_select(0, span.kv_slots).to(q.dtype)
        out[s:e] = _sdpa_one_sequence(q[s:e], k_i, v_i, scale, span.mask)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                     metadata: AttentionMetadata) -> None:
        """k/v [T, KVH, D] into the flat caches [slots, KVH, D] at metadata.slot_mapping."""
        slots = metadata.slot_mapping
        idx = metadata.write_token_indices
        if idx is not None:
            slots, k, v = slots.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx)
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled KV cache tensor. On CPU the zeros come from calloc (numpy), which maps
    fresh pages the kernel zeroes on first touch: `torch.zeros` wrote all of a 2 GiB cache at
    start-up (~2 s), this costs nothing until a block is used. Aligned to 64 bytes (a cache
    line) for the kernels' vector loads."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = np.zeros(nbytes + 64, dtype=np.uint8)
    start = -buf.ctypes.data % 64
    return torch.from_numpy(buf[start: start + nbytes]).view(dtype).view(shape)


ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def attention_backend_for(device: torch.device) -> AttentionBackend:
    """The backend for KV caches on `device`. auto: the C-kernel backend on CPU (which runs the
    torch path wherever its kernels do not apply), Triton on CUDA (the torch reference when
    triton is not installed). TIDAL_ATTENTION_BACKEND forces one: torch (the reference, any
    device), cpu, or triton (on CPU tensors only under TRITON_INTERPRET=1)."""
    choice = envs.TIDAL_ATTENTION_BACKEND
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"TIDAL_ATTENTION_BACKEND={choice!r}: expected one of {', '.join(ATTENTION_BACKENDS)}")
    if choice == "auto":
        if device.type == "cpu":
            choice = "cpu"
        else:
            choice = "triton" if device.type == "cuda" and _triton_importable() else "torch"
    if choice == "cpu" and device.type != "cpu":
        raise ValueError(f"TIDAL_ATTENTION_BACKEND=cpu needs the KV cache on the CPU, not {device.type}")
    return _shared_backend(choice)


def _triton_importable() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


@functools.cache
def _shared_backend(kind: str) -> AttentionBackend:
    """Backends hold no state, so one instance of each serves every layer."""
    if kind == "torch":
        return TorchAttentionBackend()
    if kind == "triton":
        from tidal.worker.attention_triton import TritonAttentionBackend  # imports this module

        return TritonAttentionBackend()
    from tidal.worker.attention_cpu import CpuAttentionBackend  # imports this module

    return CpuAttentionBackend()


class Attention(nn.Module):
    """Per-layer attention; `k_cache`/`v_cache` are bound by the model runner, and the backend
    follows the device they live on (chosen at the first step that reads them).

    Caches are plain attributes (not buffers) so they stay out of state_dict and `.to()`.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
        self.sliding_window = sliding_window  # None: full attention
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor = torch.empty(0)
        self.v_cache: torch.Tensor = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        metadata = get_forward_context()
        if metadata is None or self.k_cache.numel() == 0:
            # Dummy/profile run: the whole input is one causal sequence, nothing is cached.
            out = causal_attention(q, k, v, self.scale, self.sliding_window)
        else:
            if self.backend is None:
                self.backend = attention_backend_for(self.k_cache.device)
            out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale,
                                       self.sliding_window)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}{window}")
