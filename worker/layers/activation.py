"""Activations on fused projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tidal.worker.cpu_kernels import cpu_kernels, is_f32_cpu, ptr


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused gate_up projection output of width 2d."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        if x.shape[-1] % 2 == 0 and x.is_contiguous() and is_f32_cpu(x):  # one C pass, not two ops
            out = x.new_empty(*x.shape[:-1], d)
            lib = cpu_kernels()
            assert lib is not None
            lib.tidal_silu_and_mul_f32(ptr(x), ptr(out), x.numel() // (2 * d) if d else 0, d)
            return out
        return F.silu(x[..., :d]) * x[..., d:]


class GeluAndMul(nn.Module):
    """gelu(x[..., :d]) * x[..., d:] (GeGLU: Gemma's MLP); approximate "tanh" is transformers'
    gelu_pytorch_tanh, "none" the exact erf form (its "gelu")."""

    def __init__(self, approximate: str = "tanh") -> None:
        super().__init__()
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GeluAndMul: approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.gelu(x[..., :d], approximate=self.approximate) * x[..., d:]

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"
