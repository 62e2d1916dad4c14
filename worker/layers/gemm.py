"""Dense GEMM for linear layers: `F.linear`, or oneDNN with weights packed once on x86 CPUs.

torch's CPU `F.linear` in float32 goes to MKL, which on this project's AMD (Zen 4) machines is
slow for the small row counts of decode steps: 36-40 GFLOPS at 4 rows, ~140 at 32, ~175 at 4096.
oneDNN with the weight reordered once into its blocked layout gives 105-157, ~200 and ~215 on
the same shapes (`python scripts/bench_cpu_kernels.py` prints both). vLLM's CPU backend makes the same
choice. The packed weight replaces the dense one, so memory does not grow.

Set TIDAL_CPU_ONEDNN_GEMM=0 to keep every linear layer on `F.linear`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from tidal.protocol import envs

logger = logging.getLogger(__name__)

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def _onednn_self_test(dtype: torch.dtype) -> bool:
    """Pack a small weight and compare with `F.linear`: the ops are private to torch, so check
    that this build has them and that they compute the same product before relying on them."""
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 64, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 64, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
        want = F.linear(x, w, b)
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        return got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol))
    except (AttributeError, RuntimeError) as exc:
        logger.info("oneDNN packed GEMM unavailable (%s); using F.linear", exc)
        return False


def onednn_gemm_enabled(weight: torch.Tensor) -> bool:
    if not envs.TIDAL_CPU_ONEDNN_GEMM:
        return False
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2:
        return False
    if not torch.backends.mkldnn.is_available():
        return False
    if weight.dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    return _onednn_self_test(weight.dtype)


class PackedWeight:
    """A [out, in] weight in oneDNN's layout; `linear(x, bias)` == `F.linear(x, weight, bias)`."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def to_dense(self) -> torch.Tensor:
        return self.packed.to_dense()


def pack_if_enabled(weight: torch.Tensor) -> PackedWeight | None:
    return PackedWeight(weight) if onednn_gemm_enabled(weight) else None


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: PackedWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) with the packed weight when there is one, else the dense one."""
    if packed is not None:
        return packed.linear(x, bias)
    return F.linear(x, weight, bias)
