"""The torch reference attention backend (any device, torch SDPA), and plain causal attention
for a run without a KV cache (dummy/profile runs)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tidal.worker.attention_backends import AttentionBackend
from tidal.worker.attention_metadata import AttentionMetadata, PrefillSpan, visible_mask


def _expand_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[KVH, L, D] -> [KVH*groups, L, D]; on CPU this is faster than SDPA's enable_gqa path."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain causal attention over one sequence: q [T, H, D], k/v [T, KVH, D] -> [T, H, D],
    limited to the last `window` positions when given, scores soft-capped when `softcap` is,
    with a per-head sink logit [H] in every softmax when `sinks` is given."""
    mask = None
    if window is not None and q.shape[0] > window:
        pos = torch.arange(q.shape[0], device=q.device)
        mask = visible_mask(pos, pos, window)
    return _sdpa_one_sequence(q, k, v, scale, mask=mask, softcap=softcap, sinks=sinks)


# Bound on the scores one soft-capped attention call materializes (query rows x heads x keys):
# 16M float32 values, 64 MiB; longer prefills are cut into query chunks.
SOFTCAP_MAX_SCORES = 1 << 24


def softcapped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float | None,
                         mask: torch.Tensor | None, causal: bool = False,
                         sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with logit soft-capping and/or attention sinks, which SDPA cannot do: q
    [..., Lq, D] over k/v [..., Lk, D] (batch dims broadcast), mask [..., Lq, Lk] bool (True =
    may attend) or None; `causal` (with mask None): query i sees keys <= i (Lq == Lk).
    transformers' eager order: the scaled scores s become softcap * tanh(s / softcap) (when
    softcap is set), then the mask, then a float32 softmax cast back to q's dtype. `sinks`
    (broadcasting to [..., Lq, 1]): one extra logit per row in the softmax, dropped after it
    (transformers' GptOss eager attention). Cut into query chunks so the scores stay bounded."""
    lq, lk = q.shape[-2], k.shape[-2]
    per_row = max(1, q[..., :1, :1].numel() * lk)  # batch x heads x keys per query row
    chunk = max(1, SOFTCAP_MAX_SCORES // per_row)
    kt = k.transpose(-1, -2)
    outs = []
    for start in range(0, lq, chunk):
        end = min(lq, start + chunk)
        scores = torch.matmul(q[..., start:end, :], kt) * scale
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        rows = None
        if mask is not None:  # a mask may broadcast over the query rows (size 1 there)
            rows = mask if mask.shape[-2] == 1 else mask[..., start:end, :]
        elif causal:
            rows = (torch.arange(lk, device=q.device)[None, :]
                    <= torch.arange(start, end, device=q.device)[:, None])
        if rows is not None:
            scores = scores.masked_fill(~rows, float("-inf"))
        if sinks is None:
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        else:
            # The sink joins the denominator only: a row whose keys are all masked gets
            # weights 0 (not NaN), and no row's weights need sum to 1.
            sink = sinks if sinks.shape[-2] == 1 else sinks[..., start:end, :]
            sink = sink.to(scores.dtype).expand(*scores.shape[:-1], 1)
            combined = torch.cat([scores, sink], dim=-1)
            probs = torch.softmax(combined, dim=-1, dtype=torch.float32)[..., :-1].to(q.dtype)
        outs.append(torch.matmul(probs, v))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-2)


def _sdpa_one_sequence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None,
    softcap: float | None = None, sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] over k/v [S, KVH, D] -> [T, H, D]; causal when mask is None, else mask
    [T, S] (True = may attend). Inputs go in as 4-D: for 3-D ones CPU SDPA takes its math path,
    measured 1.5x slower than the flash kernel it picks for 4-D. With `softcap`, the scores are
    soft-capped, with `sinks` [H] a sink logit joins each head's softmax (softcapped_attention:
    SDPA has neither option)."""
    groups = q.shape[1] // k.shape[1]
    q4 = q.transpose(0, 1).unsqueeze(0)
    k4 = _expand_kv(k.transpose(0, 1), groups).unsqueeze(0)
    v4 = _expand_kv(v.transpose(0, 1), groups).unsqueeze(0)
    if softcap or sinks is not None:
        head_sinks = None if sinks is None else sinks.view(1, -1, 1, 1)
        out = softcapped_attention(q4, k4, v4, scale, softcap, mask, causal=mask is None, sinks=head_sinks)
    else:
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out[0].transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    """Reference backend on any device using torch SDPA.

    Decodes share one SDPA call (per bounded group): their contexts are gathered from the cache
    into one padded [B, KVH, L, D] tensor, and the query heads of each kv group become query rows
    ([B, KVH, H/KVH, D]), so GQA needs no K/V expansion. Only prefill chunks are looped over.
    A logit soft cap (Gemma 2) or attention sinks (gpt-oss) run the same gathers through
    softcapped_attention instead of SDPA.
    """

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata, scale: float,
                sliding_window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        flat_k = k_cache.view(-1, num_kv_heads, head_dim)
        flat_v = v_cache.view(-1, num_kv_heads, head_dim)
        self._write_cache(k, v, flat_k, flat_v, metadata)
        out = q.new_empty(q.shape)
        if metadata.decode_seqs:
            out = self._decode(q, k_cache, v_cache, metadata, scale, out, sliding_window, softcap, sinks)
        for span in metadata.prefill_spans(sliding_window):
            self._prefill(q, k, v, flat_k, flat_v, span, scale, out, softcap, sinks)
        return out

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                metadata: AttentionMetadata, scale: float, out: torch.Tensor,
                window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of every decode token; fills its rows of out and returns out (or, for a
        pure-decode batch, may return a new tensor instead)."""
        num_tokens, num_heads = q.shape[0], q.shape[1]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        q_per_kv = num_heads // num_kv_heads
        # Query heads are the rows of each kv group here: head kv * q_per_kv + j is row j.
        group_sinks = None if sinks is None else sinks.view(1, num_kv_heads, q_per_kv, 1)
        for group in metadata.decode_groups_for(window):
            n, length, idx = group.num, group.gather_len, group.token_indices
            q_dec = q[group.token_start : group.token_start + n] if idx is None else q.index_select(0, idx)
            # .to: a half cache under float32 compute (a no-op when the dtypes match)
            k_dec = k_cache.index_select(0, group.kv_blocks).view(n, length, num_kv_heads, head_dim).to(q.dtype)
            v_dec = v_cache.index_select(0, group.kv_blocks).view(n, length, num_kv_heads, head_dim).to(q.dtype)
            q_grouped = q_dec.view(n, num_kv_heads, q_per_kv, head_dim)
            k_t, v_t = k_dec.transpose(1, 2), v_dec.transpose(1, 2)
            if softcap or group_sinks is not None:
                o_dec = softcapped_attention(q_grouped, k_t, v_t, scale, softcap, group.mask, sinks=group_sinks)
            else:
                o_dec = F.scaled_dot_product_attention(q_grouped, k_t, v_t, attn_mask=group.mask, scale=scale)
            o_dec = o_dec.reshape(n, num_heads, head_dim)
            if n == num_tokens:
                return o_dec  # pure decode batch: nothing to scatter
            if idx is None:
                out[group.token_start : group.token_start + n] = o_dec
            else:
                out.index_copy_(0, idx, o_dec)
        return out

    @staticmethod
    def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                 span: PrefillSpan, scale: float, out: torch.Tensor, softcap: float | None = None,
                 sinks: torch.Tensor | None = None) -> None:
        s, e = span.q_start, span.q_end
        if span.kv_slots is None:
            k_i, v_i = k[s:e], v[s:e]
        else:
            k_i = flat_k.index_select(0, span.kv_slots).to(q.dtype)
            v_i = flat_v.index_select(0, span.kv_slots).to(q.dtype)
        out[s:e] = _sdpa_one_sequence(q[s:e], k_i, v_i, scale, span.mask, softcap, sinks)

    def _write_cache(self, k: torch.Tensor, v: torch.Tensor, flat_k: torch.Tensor, flat_v: torch.Tensor,
                     metadata: AttentionMetadata) -> None:
        """k/v [T, KVH, D] into the flat caches [slots, KVH, D] at metadata.slot_mapping."""
        slots = metadata.slot_mapping
        idx = metadata.write_token_indices
        if idx is not None:
            slots, k, v = slots.index_select(0, idx), k.index_select(0, idx), v.index_select(0, idx)
        flat_k.index_copy_(0, slots, k.to(flat_k.dtype))
        flat_v.index_copy_(0, slots, v.to(flat_v.dtype))

