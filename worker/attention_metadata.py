"""What an attention backend reads about one step's batch: `AttentionMetadata`, built once per
step by the model runner, and the views derived from it on first use (prefill spans, decode
groups, the C-kernel backend's paged batch), each built once per step and window, not once
per layer.

Everything that depends only on the batch layout (which tokens decode, which cache slots to
gather, masks) is computed here, not in the backends.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from tidal.protocol.sizing import cdiv


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


# Longest query a sequence may have and still be attended one query row at a time by a paged
# decode kernel (`AttentionMetadata.short_seqs`, opt-in per backend: the CPU one), rather than as
# a prefill chunk: row j of a sequence with q query rows and seq_len is a decode with context
# seq_len - q + 1 + j, since a step writes all its K/V before attention reads. Speculative
# verification (1 + k rows) is the case it exists for. The kernel's cost grows with q x context
# (each row reads its whole context), the prefill path's gather and SDPA call far more slowly in
# q: measured on one thread (scripts/bench_verify_rows.py, contexts 64..4096, batch 1..32) the
# kernel is 2-10x faster at q = 2, 1.3-2.8x at q = 5, about even to 1.9x at q = 9 (0.83x at the
# worst, context 2048), and loses from q = 11-17 on (later the shorter the context). 9 covers a
# verification of up to 8 proposals.
PAGED_ROWS_MAX_QUERY_LEN = 9

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


def visible_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[len(q_pos), len(k_pos)] bool: key position j is visible to query position i (causal,
    and i - window < j under a sliding window)."""
    visible = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        visible &= k_pos[None, :] > q_pos[:, None] - window
    return visible


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

    def prefill_spans(self, window: int | None, paged_rows: bool = False) -> list[PrefillSpan]:
        """The sequences with query_len > 1, with what a per-sequence SDPA needs (cache slots
        and mask when earlier context is cached, or when a sliding window cuts into the chunk)
        for layers of this window. paged_rows: leave out `short_seqs` (a backend attending them
        row by row through `paged_rows`). Built on first use: kernels that read the paged cache
        directly never need it."""
        key = ("prefills", window, paged_rows and bool(self.short_seqs))
        if key not in self._window_views:
            self._window_views[key] = self._build_prefill_spans(window, key[2])
        return self._window_views[key]

    def _build_prefill_spans(self, window: int | None, skip_short: bool = False) -> list[PrefillSpan]:
        device = self.block_tables.device
        bs = self.block_size
        spans: list[PrefillSpan] = []
        skip = set(self.short_seqs) if skip_short else ()
        for i in range(self.num_seqs):
            start, end, seq_len = self.query_start_loc[i], self.query_start_loc[i + 1], self.seq_lens[i]
            q_len = end - start
            if q_len <= 1 or i in skip:
                continue
            span = PrefillSpan(start, end, seq_len)
            context = seq_len - q_len
            if context > 0:  # earlier context lives in the cache
                # The chunk's first query (at `context`) reads back to window_start of it + 1.
                pos = torch.arange(window_start(context + 1, window), seq_len, device=device)
                span.kv_slots = self.block_tables[i, pos // bs] * bs + pos % bs
                q_pos = torch.arange(context, seq_len, device=device)
                span.mask = visible_mask(q_pos, pos, window)
            elif window is not None and q_len > window:  # causal alone would see too far back
                pos = torch.arange(q_len, device=device)
                span.mask = visible_mask(pos, pos, window)
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
        """The decodes (query_len == 1), one kernel row each."""
        from tidal.worker.attention_cpu import PagedDecodeBatch

        return PagedDecodeBatch.build(self)

    @functools.cached_property
    def short_seqs(self) -> list[int]:
        """Batch indices of the sequences with 2..PAGED_ROWS_MAX_QUERY_LEN query rows and
        earlier context in the cache (a speculative verification, a short chunk): what a paged
        decode kernel may attend row by row (`paged_rows`) instead of as prefill chunks. A chunk
        that is its whole context is left to the prefill path: that attends its new K/V as
        computed, the kernel would read them back from the cache (rounded, in a half cache)."""
        if self.max_query_len < 2:
            return []
        qsl, lens = self.query_start_loc, self.seq_lens
        return [i for i in range(self.num_seqs)
                if 1 < qsl[i + 1] - qsl[i] <= PAGED_ROWS_MAX_QUERY_LEN and lens[i] > qsl[i + 1] - qsl[i]]

    @functools.cached_property
    def paged_rows(self) -> "PagedDecodeBatch":  # noqa: F821 - the C-kernel backend's view
        """paged_decode plus one kernel row per query row of each of `short_seqs`: row j of a
        sequence with q rows is a decode with context seq_len - q + 1 + j over the same block
        table row (the step writes every new token's K/V before attention reads, so the
        context is in the cache; a window counts back from the row's own position)."""
        if not self.short_seqs:
            return self.paged_decode
        from tidal.worker.attention_cpu import PagedDecodeBatch

        return PagedDecodeBatch.build(self, self.short_seqs)

