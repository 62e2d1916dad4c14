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

    @property
    def kernel_weight(self) -> torch.Tensor:
        """The per-channel multiplier the C kernels apply (w * x / rms): the weight itself here;
        GemmaRMSNorm's is 1 + weight."""
        return self.weight

    def _kernel_applies(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        weight = self.kernel_weight
        if x.shape[-1] != weight.numel() or not x.is_contiguous() or not weight.is_contiguous():
            return False  # wrong widths: the torch ops raise the error
        if residual is None:
            return is_f32_cpu(x, weight)
        return residual.shape == x.shape and residual.is_contiguous() and is_f32_cpu(x, residual, weight)

    def _forward_kernel(
        self, x: torch.Tensor, residual: torch.Tensor | None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        lib = cpu_kernels()
        assert lib is not None
        dim = x.shape[-1]
        rows = x.numel() // dim if dim else 0
        if residual is None:
            out = torch.empty_like(x)
            lib.tidal_rms_norm_f32(ptr(x), dim, ptr(out), ptr(self.kernel_weight), self.variance_epsilon, rows, dim)
            return out
        lib.tidal_fused_add_rms_norm_f32(ptr(x), ptr(residual), ptr(self.kernel_weight), self.variance_epsilon,
                                         rows, dim)
        return x, residual

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint's weight w is an offset, the output x / rms(x) * (1 + w),
    computed in float32 and cast back once at the end (HF Gemma2RMSNorm / Gemma3RMSNorm, which
    differ from Llama's in both: Llama casts before it scales).

    1 + w is kept in float32 (`scale`, made from the loaded weight after loading, or on first
    use), as transformers computes it: rounding 1 + w to a half dtype would lose w's low bits.
    """

    dummy_weight = 0.0  # load_format="dummy": a scale of 1, as other norms get

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__(hidden_size, eps)
        self.weight = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)  # HF's init: 0
        self.register_buffer("scale", None, persistent=False)

    def process_weights_after_loading(self) -> None:
        self.scale = 1.0 + self.weight.detach().float()

    @property
    def kernel_weight(self) -> torch.Tensor:
        if self.scale is None or self.scale.device != self.weight.device:
            self.process_weights_after_loading()
        return self.scale

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (xf * self.kernel_weight).to(x.dtype)
