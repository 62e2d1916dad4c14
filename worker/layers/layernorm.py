"""RMSNorm with an optional fused residual add (vLLM convention).

On CPU in float32 both forms run as one C kernel (csrc/elementwise.c) instead of ~7 torch ops;
the residual form then works in place, like vLLM's fused_add_rms_norm: the caller's `x` and
`residual` tensors become the returned (normed, residual) pair and must not be reused.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.cpu_kernels import cpu_kernels, is_f32_cpu, ptr


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)  # default dtype, as the loader sets

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # Same op order as HF LlamaRMSNorm: normalize in float32, cast back, then scale, so
        # bf16/fp16 outputs match transformers bit for bit.
        input_dtype = x.dtype
        xf = x.float()
        variance = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * xf.to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._kernel_applies(x, residual):
            return self._forward_kernel(x, residual)
        if residual is None:
            return self._norm(x)
        # The add happens in the model dtype, exactly like HF's `residual + hidden_states`.
        residual = x + residual
        return self._norm(residual), residual

    def _kernel_applies(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        if x.shape[-1] != self.weight.numel() or not x.is_contiguous():
            return False  # wrong widths: the torch ops raise the error
        if residual is None:
            return is_f32_cpu(x, self.weight)
        return residual.shape == x.shape and residual.is_contiguous() and is_f32_cpu(x, residual, self.weight)

    def _forward_kernel(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        lib = cpu_kernels()
        assert lib is not None
        dim = x.shape[-1]
        rows = x.numel() // dim if dim else 0
        if residual is None:
            out = torch.empty_like(x)
            lib.tidal_rms_norm_f32(ptr(x), dim, ptr(out), ptr(self.weight), self.variance_epsilon, rows, dim)
            return out
        lib.tidal_fused_add_rms_norm_f32(ptr(x), ptr(residual), ptr(self.weight), self.variance_epsilon, rows, dim)
        return x, residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"
