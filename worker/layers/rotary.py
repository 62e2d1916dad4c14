"""Rotary position embedding (neox / rotate_half style, as HF Llama) applied by position ids.

cos/sin are cached in float32 for every position up to max_position and cast to the query
dtype when applied, the same rounding HF uses, so bf16 results match transformers. One table
serves every layer; layers/qk_norm_rope.py applies it (fused with Qwen3's q/k norms on CPU).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_params_from_config(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling or None) from either the transformers>=5 `rope_parameters`
    dict or the older `rope_theta` / `rope_scaling` attributes."""
    params = getattr(hf_config, "rope_parameters", None)
    scaling = getattr(hf_config, "rope_scaling", None)
    theta = getattr(hf_config, "rope_theta", None)
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", theta)
        scaling = params
    if theta is None:
        theta = (scaling or {}).get("rope_theta", 10000.0)
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type == "default":
            scaling = None
        elif rope_type == "su":  # older Phi-3 configs' name for longrope (as Phi3Config reads it)
            scaling = {**scaling, "rope_type": "longrope"}
            scaling.pop("type", None)
    return float(theta), (dict(scaling) if scaling is not None else None)


def rotary_dim_from_config(hf_config: Any, head_dim: int) -> int:
    """How many leading dimensions of each head RoPE rotates: head_dim x partial_rotary_factor
    (Phi-4-mini 0.75), from transformers>=5's `rope_parameters` or the config's own field."""
    params = getattr(hf_config, "rope_parameters", None)
    factor = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    if factor is None:
        factor = getattr(hf_config, "partial_rotary_factor", None)
    return head_dim if factor is None else int(head_dim * float(factor))


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # As transformers' _compute_llama3_parameters: long wavelengths are divided by `factor`,
    # short ones kept, the band between interpolated smoothly.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(base: float, dim: int, scaling: dict[str, Any], original: int, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) as transformers' _compute_yarn_parameters: per dimension a blend of
    the original frequency and the one divided by `factor`, ramped between the dimensions
    that turn beta_fast and beta_slow times over the original context; cos/sin scaled by the
    attention factor."""
    factor = scaling.get("factor") or max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** _exponents(dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def _longrope_attention(scaling: dict[str, Any], original: int, max_position: int) -> float:
    factor = scaling.get("factor") or max_position / original
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_frequencies(rope_type: str, base: float, dim: int, scaling: dict[str, Any], max_position: int,
                     original: int, num_positions: int) -> tuple[torch.Tensor, torch.Tensor | None, float]:
    """(inv_freq, inv_freq from position `original` on or None, attention factor) of one RoPE
    type, as transformers' ROPE_INIT_FUNCTIONS compute them. `max_position` is the config's
    max_position_embeddings, `original` the pre-training context (original_max_position_embeddings,
    else max_position), `num_positions` the positions the engine serves.

    transformers picks "dynamic" and "longrope" frequencies per forward pass from the longest
    sequence in it, with its cache keeping keys rotated by earlier choices: a batched engine
    cannot reproduce that. "dynamic" is evaluated once, at the longest sequence served
    (transformers' value for `num_positions` tokens; the engine serves max_position_embeddings
    x factor, protocol/config.model_positions, so this is vLLM's table): it differs from
    transformers for sequences transformers still leaves unscaled. "longrope" is chosen per position (short factors below `original`, long ones from
    there on, as vLLM), which equals transformers for a sequence decoded token by token from a
    prompt shorter than `original`."""
    inv_freq = 1.0 / (base ** _exponents(dim))
    if rope_type == "default":
        return inv_freq, None, 1.0
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"]), None, 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling), None, 1.0
    if rope_type == "dynamic":
        factor = float(scaling["factor"])
        seq_len = max(num_positions, max_position)
        scaled = base * ((factor * seq_len / max_position) - (factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (scaled ** _exponents(dim)), None, 1.0
    if rope_type == "yarn":
        inv_freq, attention = _yarn(base, dim, scaling, original, max_position)
        return inv_freq, None, attention
    if rope_type == "longrope":
        short = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float32) * base ** _exponents(dim))
        long = 1.0 / (torch.tensor(scaling["long_factor"], dtype=torch.float32) * base ** _exponents(dim))
        return short, long, _longrope_attention(scaling, original, max_position)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported ({', '.join(ROPE_TYPES)} are)")


ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
        original_max_position: int | None = None,
        num_positions: int | None = None,
    ) -> None:
        """`max_position`: the config's max_position_embeddings; `original_max_position`: the
        pre-training context when the config holds it outside rope_scaling (Phi-3's top-level
        original_max_position_embeddings); `num_positions`: positions served, if more than
        max_position (a context extended by the scaling)."""
        super().__init__()
        if not 0 < rotary_dim <= head_size or rotary_dim % 2:
            raise ValueError(f"rotary_dim {rotary_dim} must be even and in (0, head_size {head_size}]")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max(num_positions or max_position, max_position)  # rows of the tables
        self.base = base
        rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        self.rope_type = rope_type
        scaling = rope_scaling or {}
        original = int(scaling.get("original_max_position_embeddings") or original_max_position or max_position)
        inv_freq, long_inv_freq, attention = rope_frequencies(rope_type, base, rotary_dim, scaling, max_position,
                                                              original, self.max_position)
        t = torch.arange(self.max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :]
        if long_inv_freq is not None:  # longrope: the long factors from the original context on
            freqs[original:] = t[original:, None] * long_inv_freq[None, :]
        # Half-width tables: the two halves of HF's cat((freqs, freqs)) are equal. HF scales
        # cos and sin by the attention factor in float32 before casting, as here.
        self.register_buffer("cos_cache", freqs.cos() * attention, persistent=False)
        self.register_buffer("sin_cache", freqs.sin() * attention, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x*cos + rotate_half(x)*sin written per half; same roundings as HF's formula.
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def forward(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query [T, H*D] or [T, H, D], key likewise; returns tensors of the input shapes."""
        num_tokens = positions.shape[0]
        cos = self.cos_cache.index_select(0, positions).to(query.dtype).unsqueeze(1)
        sin = self.sin_cache.index_select(0, positions).to(query.dtype).unsqueeze(1)
        q = self._rotate_heads(query.view(num_tokens, -1, self.head_size), cos, sin).view_as(query)
        k = self._rotate_heads(key.view(num_tokens, -1, self.head_size), cos, sin).view_as(key)
        return q, k

    def _rotate_heads(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim == self.head_size:
            return self._rotate(x, cos, sin)
        # Partial rotary (transformers' apply_rotary_pos_emb): the first rotary_dim dims of each
        # head rotate, the rest pass through.
        return torch.cat((self._rotate(x[..., : self.rotary_dim], cos, sin), x[..., self.rotary_dim :]), dim=-1)

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, max_position={self.max_position}, "
                f"base={self.base}, type={self.rope_type}")

