"""The `Attention` layer over a paged KV cache.

The model runner builds one `AttentionMetadata` per step (worker/attention_metadata.py), enters
`set_forward_context(meta)` around `model.forward` (worker/forward_context.py), and every
`Attention` layer reads it from `get_forward_context()` and hands it to the backend its KV
cache's device gets (worker/attention_backends.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.attention_backends import AttentionBackend, attention_backend_for
from tidal.worker.attention_torch import causal_attention
from tidal.worker.forward_context import get_forward_context


class Attention(nn.Module):
    """Per-layer attention; `k_cache`/`v_cache` are bound by the model runner, and the backend
    follows the device they live on (chosen at the first step that reads them).

    Caches are plain attributes (not buffers) so they stay out of state_dict and `.to()`.
    """

    def __init__(self, num_heads: int, head_dim: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None), got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 (or None), got {logits_soft_cap}")
        self.sliding_window = sliding_window  # None: full attention
        # vLLM's name: scores s -> cap * tanh(s / cap) before the softmax (Gemma 2); None: none.
        self.logits_soft_cap = logits_soft_cap
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        self.backend: AttentionBackend | None = None
        self.k_cache: torch.Tensor = torch.empty(0)
        self.v_cache: torch.Tensor = torch.empty(0)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H*D], k/v [T, KVH*D] -> [T, H*D]; sinks [H]: gpt-oss's per-head sink logits
        (see AttentionBackend.forward), held by the model's attention module."""
        num_tokens = q.shape[0]
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        metadata = get_forward_context()
        if metadata is None or self.k_cache.numel() == 0:
            # Dummy/profile run: the whole input is one causal sequence, nothing is cached.
            out = causal_attention(q, k, v, self.scale, self.sliding_window, self.logits_soft_cap, sinks)
        else:
            if self.backend is None:
                self.backend = attention_backend_for(self.k_cache.device)
            out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, metadata, self.scale,
                                       self.sliding_window, softcap=self.logits_soft_cap, sinks=sinks)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        window = "" if self.sliding_window is None else f", sliding_window={self.sliding_window}"
        cap = "" if self.logits_soft_cap is None else f", logits_soft_cap={self.logits_soft_cap}"
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"scale={self.scale:.4g}{window}{cap}")
