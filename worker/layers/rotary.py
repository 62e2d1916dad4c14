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
    return float(theta), (dict(scaling) if scaling is not None else None)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Mirrors transformers' _compute_llama3_parameters: long wavelengths are divided by
    # `factor`, short ones kept, the band between interpolated smoothly.
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


class RotaryEmbedding(nn.Module):
    def __init__(
        self,
        head_size: int,
        rotary_dim: int,
        max_position: int,
        base: float,
        rope_scaling: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        if rotary_dim != head_size:
            raise NotImplementedError("partial rotary embeddings are not supported")
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.max_position = max_position
        self.base = base
        rope_type = "default" if rope_scaling is None else rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
        self.rope_type = rope_type
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling or {})
        elif rope_type == "linear":
            inv_freq = inv_freq / float((rope_scaling or {})["factor"])
        elif rope_type != "default":
            raise NotImplementedError(f"rope_type {rope_type!r} is not supported (default, llama3, linear are)")
        t = torch.arange(max_position, dtype=torch.float32)
        freqs = t[:, None] * inv_freq[None, :].to(t.device)
        # Half-width tables: the two halves of HF's cat((freqs, freqs)) are equal.
        self.register_buffer("cos_cache", freqs.cos(), persistent=False)
        self.register_buffer("sin_cache", freqs.sin(), persistent=False)

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
        q = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin).view_as(query)
        k = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin).view_as(key)
        return q, k

    def extra_repr(self) -> str:
        return f"head_size={self.head_size}, max_position={self.max_position}, base={self.base}, type={self.rope_type}"

