"""QKNormRope: from the fused qkv projection to attention's q, k, v.

It splits the projection output [T, (Hq + 2 Hkv) * D] into q, k and v, normalizes each q and k
head with its own RMSNorm when the family has them (Qwen3), and applies RoPE to q and k. On CPU
in float32 all of it is one C pass in place on the projection output (csrc/elementwise.c);
otherwise the torch ops of RMSNorm and RotaryEmbedding run, with HF's roundings.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.cpu_kernels import cpu_kernels, is_f32_cpu, ptr
from tidal.worker.layers.layernorm import RMSNorm
from tidal.worker.layers.rotary import RotaryEmbedding


class QKNormRope(nn.Module):
    def __init__(self, rotary_emb: RotaryEmbedding, num_heads: int, num_kv_heads: int,
                 norm_eps: float | None, norm_cls: type[RMSNorm] = RMSNorm) -> None:
        """`norm_eps` None: no q/k norms (Llama); else the eps of both per-head RMSNorms, of
        class `norm_cls` (GemmaRMSNorm for Gemma 3's 1 + weight convention)."""
        super().__init__()
        self.rotary_emb = rotary_emb  # one cos/sin table shared by every layer
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = rotary_emb.head_size
        self.split_sizes = [num_heads * self.head_dim, num_kv_heads * self.head_dim, num_kv_heads * self.head_dim]
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if norm_eps is not None:
            self.q_norm = norm_cls(self.head_dim, eps=norm_eps)
            self.k_norm = norm_cls(self.head_dim, eps=norm_eps)

    def forward(self, positions: torch.Tensor, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """positions [T], qkv [T, (Hq + 2 Hkv) * D] -> q [T, Hq * D], k and v [T, Hkv * D].
        The fused path rewrites qkv in place: the caller must not read it afterwards."""
        if self._kernel_applies(positions, qkv):
            self._forward_kernel(positions, qkv)
            q, k, v = qkv.split(self.split_sizes, dim=-1)
            return q, k, v
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        num_tokens = q.shape[0]
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k)
        return q.reshape(num_tokens, -1), k.reshape(num_tokens, -1), v

    def _norm_weights(self) -> list[torch.Tensor]:
        return [n.kernel_weight for n in (self.q_norm, self.k_norm) if n is not None]

    def _kernel_applies(self, positions: torch.Tensor, qkv: torch.Tensor) -> bool:
        """Shapes and layouts the kernel reads correctly; anything else takes the torch ops,
        which then raise whatever shape error there is."""
        width = sum(self.split_sizes)
        weights = self._norm_weights()
        return (
            qkv.dim() == 2 and qkv.shape[1] == width and qkv.stride(1) == 1 and qkv.stride(0) >= width
            and positions.shape == (qkv.shape[0],) and positions.device.type == "cpu" and self.head_dim % 2 == 0
            and self.rotary_emb.rotary_dim == self.head_dim  # the kernel rotates whole heads
            and all(w.shape == (self.head_dim,) and w.is_contiguous() for w in weights)
            and is_f32_cpu(qkv, self.rotary_emb.cos_cache, *weights)
        )

    def _forward_kernel(self, positions: torch.Tensor, qkv: torch.Tensor) -> None:
        rope = self.rotary_emb
        pos = positions if positions.dtype == torch.int64 and positions.is_contiguous() else positions.long().contiguous()
        q_w, k_w = (None if n is None else ptr(n.kernel_weight) for n in (self.q_norm, self.k_norm))
        eps = 0.0 if self.q_norm is None else self.q_norm.variance_epsilon
        lib = cpu_kernels()
        assert lib is not None  # _kernel_applies built it
        rc = lib.tidal_qk_norm_rope_f32(
            ptr(qkv), qkv.stride(0), qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim,
            q_w, k_w, eps, ptr(pos), ptr(rope.cos_cache), ptr(rope.sin_cache), rope.max_position)
        if rc != 0:
            raise IndexError(f"rotary embedding: a position is outside [0, {rope.max_position})")

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, qk_norm={self.q_norm is not None}"
