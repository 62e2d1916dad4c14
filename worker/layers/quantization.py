"""int8 weights for CPU linear layers (`quantization="int8"`): blocks of 32 int8 values + a float32 scale.

Why: a decode step reads every weight once, so its time is the bytes read; a block of 32 weights
takes 36 bytes (9/32 of float32, 56% of bf16). The format follows llama.cpp's Q8_0 (there with
an fp16 scale): per block of 32 along K, scale d = max |w| / 127 and q = rint(w / d) in
[-127, 127], so w ~ d * q. The kernel (csrc/int8_gemm.c) quantizes each activation row the same
way on the fly and sums exact int8 x int8 products per block, as llama.cpp does.

A dense checkpoint is quantized at load (quantize_model); activations, biases and everything
outside the linear layers stay float32. MoE experts keep their dense GEMM.
"""

from __future__ import annotations

import torch
from torch import nn

from tidal.worker.cpu_kernels import cpu_kernels

QK = 32  # values per block
QUANTIZATION_METHODS = ("int8",)


def quantize_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[R, K] float -> (q int8 [R, kb * 32], d float32 [R, kb]), kb = ceil(K / 32): the rule of
    csrc/int8_gemm.c's quantize_row (float32 division, rint: ties to even), zero padded."""
    x = x.detach().float()
    rows, k = x.shape
    kb = -(-k // QK)
    padded = torch.zeros(rows, kb * QK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x
    blocks = padded.view(rows, kb, QK)
    d = blocks.abs().amax(dim=2) / 127.0
    q = torch.where(d[:, :, None] > 0, torch.round(blocks / d[:, :, None].clamp_min(torch.finfo(torch.float32).tiny)),
                    torch.zeros((), device=x.device))
    return q.clamp_(-127, 127).to(torch.int8).view(rows, kb * QK), d.contiguous()


def dequantize_blocks(q: torch.Tensor, d: torch.Tensor, k: int) -> torch.Tensor:
    """(q, d) back to the [R, K] float32 weight they stand for: d * q."""
    rows = q.shape[0]
    return (q.view(rows, -1, QK).float() * d[:, :, None]).view(rows, -1)[:, :k].contiguous()


class Int8Weight:
    """A [out, in] weight held as int8 blocks; `linear(x, bias)` takes and returns float32 and
    equals x_q @ W_q^T (+ bias), x_q / W_q the block-quantized x and weight."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or not weight.is_floating_point() or weight.device.type != "cpu":
            raise ValueError(f"int8 quantization takes a 2-D float CPU weight, got {tuple(weight.shape)} "
                             f"{weight.dtype} {weight.device}")
        self.shape = tuple(weight.shape)
        self.dtype = torch.int8
        self.q, self.d = quantize_blocks(weight)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if x.dim() != 2:
            return self.linear(x.reshape(-1, k), bias).view(*x.shape[:-1], n)
        if x.dtype != torch.float32 or x.shape[1] != k:
            raise ValueError(f"expected a float32 input of shape [M, {k}], got {tuple(x.shape)} {x.dtype}")
        if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (n,)):
            raise ValueError(f"expected a float32 bias of shape [{n}], got {tuple(bias.shape)} {bias.dtype}")
        lib = cpu_kernels()
        if lib is None:  # TIDAL_CPU_KERNELS=0: the same quantized product in torch
            xq, xd = quantize_blocks(x)
            return int8_reference(xq, xd, self.q, self.d, bias).float()
        m = x.shape[0]
        if k > 0 and (x.stride(1) != 1 or (m > 1 and x.stride(0) < k)):
            x = x.contiguous()
        if bias is not None:
            bias = bias.contiguous()
        out = torch.empty(m, n, dtype=torch.float32)
        rc = lib.tidal_int8_gemm(x.data_ptr(), x.stride(0) if m > 1 else k, self.q.data_ptr(), self.d.data_ptr(),
                                 0 if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k)
        if rc != 0:
            raise RuntimeError(f"tidal_int8_gemm failed with code {rc}" + (" (out of memory)" if rc == -2 else ""))
        return out

    def to_dense(self) -> torch.Tensor:
        return dequantize_blocks(self.q, self.d, self.shape[1])

    @property
    def nbytes(self) -> int:
        return self.q.numel() + self.d.numel() * 4


def int8_reference(xq: torch.Tensor, xd: torch.Tensor, wq: torch.Tensor, wd: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """float64 x_q @ W_q^T (+ bias): per block the exact integer dot times xd * wd."""
    m, n, kb = xq.shape[0], wq.shape[0], xd.shape[1]
    isum = torch.einsum("mbi,nbi->mnb", xq.view(m, kb, QK).double(), wq.view(n, kb, QK).double())
    out = (isum * xd.double()[:, None, :] * wd.double()[None, :, :]).sum(dim=2)
    return out if bias is None else out + bias.double()


def check_quantization(quantization: str | None, device: torch.device | str) -> None:
    """A clear error for what tidal cannot quantize: an unknown method, or int8 off the CPU."""
    if quantization is None:
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization={quantization!r} is not supported; tidal has: "
                         f"{', '.join(QUANTIZATION_METHODS)} (or None)")
    if torch.device(device).type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on CPUs only, not on {torch.device(device).type}")
    if cpu_kernels() is None:
        raise ValueError(f"quantization={quantization!r} needs tidal's C kernels (TIDAL_CPU_KERNELS=0 or no C "
                         "compiler)")


def quantize_model(model: nn.Module) -> int:
    """Every dense linear layer (and the LM head) of a loaded model to int8 blocks, in place;
    returns the layers quantized. Modules with a `packed_weight` slot hold their GEMM weight
    there (layers/linear.py, layers/embedding.py): it becomes an Int8Weight, the dense copy
    goes (a tied LM head keeps the embedding's table, which the embedding still reads)."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "packed_weight"):
            continue
        packed = module.packed_weight
        weight = getattr(module, "weight", None)
        dense = packed.to_dense() if packed is not None else weight
        if not isinstance(dense, torch.Tensor) or dense.dim() != 2:
            continue
        module.packed_weight = Int8Weight(dense)
        if not getattr(module, "tied", False) and isinstance(weight, torch.Tensor):
            module.weight = None
        count += 1
    return count
