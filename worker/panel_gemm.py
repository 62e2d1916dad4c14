"""Linear layers on CPUs through tidal's own GEMM: x (float32) @ W^T with W in float32, fp16 or bf16.

Why: a decode step reads every weight of the model once for a handful of rows, so on CPUs its
GEMMs are bound by the bytes read; weights held in 16 bits halve those bytes (and the memory).
oneDNN has no fp16/bf16 GEMM for AVX2-only CPUs, hence a kernel of our own (csrc/gemm_panels.c).
Activations and arithmetic stay float32; a half weight is rounded once, exactly as
`weight.to(dtype)` rounds it. float32 weights use the same kernel where it is vectorized: as fast
as oneDNN's packed GEMM, and nothing is built per row count (no cold steps, no growing cache).

Packed layout (the C kernel's): a [ceil(N / 16), K, 16] tensor of the weight's dtype, panel p
holding output columns 16 p .. 16 p + 15 (zero columns pad the last panel) with K as the middle
index, so the kernel reads 16 columns of one k as contiguous bytes. For bf16 the 16 slots of a
row hold columns 0, 8, 1, 9, ..., 7, 15 (see _BF16_SLOTS), which lets the kernel widen them with
one shift and one mask. The packed tensor's dtype says which kind it is.

Batches of 1-4 rows (decode) run csrc/gemv.c instead: the same layout and bit-identical results,
with each weight stream prefetched ahead, since there the weight's read rate is all that counts.
"""

from __future__ import annotations

import functools

import torch

from tidal.worker.cpu_kernels import cpu_kernels

_NR = 16  # output columns per panel
GEMV_MAX_ROWS = 4  # rows up to which run_panel_gemm calls csrc/gemv.c (its limit too)
_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # csrc/gemm_panels.c's W_F32, W_F16, W_BF16
# bf16 slot s of a panel row holds column _BF16_SLOTS[s]: even slots columns 0-7, odd ones 8-15.
_BF16_SLOTS = torch.tensor([c for pair in zip(range(8), range(8, 16)) for c in pair])
_BF16_COLUMNS = torch.argsort(_BF16_SLOTS)  # the inverse: column c sits in slot _BF16_COLUMNS[c]


@functools.cache
def panel_gemm_available(dtype: torch.dtype) -> bool:
    """The kernel is built for weights of `dtype`: fp16/bf16 whenever the C kernels are (the
    portable C path is still far faster than torch's CPU half ops); float32 only where the
    vectorized path was compiled (plain C would lose to oneDNN)."""
    lib = cpu_kernels()
    if lib is None or dtype not in _KINDS or not hasattr(lib, "tidal_gemm_panels"):
        return False
    return dtype != torch.float32 or bool(lib.tidal_gemm_panels_simd())


def pack_weight(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, K] weight of any float dtype -> the packed [ceil(N / 16), K, 16] tensor of `dtype`."""
    if dtype not in _KINDS:
        raise ValueError(f"panel weights are float32, float16 or bfloat16, not {dtype}")
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"expected a 2-D float weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    panels = -(-n // _NR)
    rounded = weight.detach().to(dtype)  # the one rounding, as weight.to(dtype) (no copy if equal)
    if n % _NR:  # zero columns pad the last panel
        rounded = torch.cat([rounded, rounded.new_zeros(panels * _NR - n, k)])
    packed = rounded.reshape(panels, _NR, k).transpose(1, 2)  # [P, K, 16]; contiguous() copies once
    if dtype == torch.bfloat16:
        packed = packed[:, :, _BF16_SLOTS.to(weight.device)]
    return packed.contiguous()


def unpack_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The packed tensor back to the [N, K] weight, in its dtype (bit-exact)."""
    _check_packed(packed, n, k)
    if packed.dtype == torch.bfloat16:
        packed = packed[:, :, _BF16_COLUMNS.to(packed.device)]
    return packed.transpose(1, 2).reshape(packed.shape[0] * _NR, k)[:n].clone()


def _check_packed(packed: torch.Tensor, n: int, k: int) -> None:
    want = (-(-n // _NR), k, _NR)
    if packed.dtype not in _KINDS or tuple(packed.shape) != want or not packed.is_contiguous():
        raise ValueError(f"expected a contiguous packed weight of shape {want}, got "
                         f"{tuple(packed.shape)} {packed.dtype}")


def panel_linear(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided) @ W^T (+ bias [N] float32) -> new float32 [M, N]."""
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"expected a float32 CPU input of shape [M, {k}], got {tuple(x.shape)} {x.dtype} {x.device}")
    _check_packed(packed, n, k)
    if packed.device.type != "cpu":
        raise ValueError("the packed weight must be on the CPU")
    if bias is not None and (bias.shape != (n,) or bias.dtype != torch.float32 or bias.device.type != "cpu"):
        raise ValueError(f"expected a float32 CPU bias of shape [{n}], got {tuple(bias.shape)} {bias.dtype}")
    return run_panel_gemm(x, packed, n, k, bias)


def run_panel_gemm(x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """panel_linear without its argument checks, for callers that made them once (PanelWeight
    packed the weight itself; it checks the input's dtype): it runs per layer per step."""
    lib = cpu_kernels()
    if lib is None:  # TIDAL_CPU_KERNELS=0 after the weights were packed: the same product in torch
        return torch.nn.functional.linear(x, unpack_weight(packed, n, k).float(), bias)
    m = x.shape[0]
    if k > 0 and (x.stride(1) != 1 or (m > 1 and x.stride(0) < k)):
        x = x.contiguous()  # the kernel reads each row's K values back to back, rows apart
    if bias is not None:
        bias = bias.contiguous()
    out = torch.empty(m, n, dtype=torch.float32)
    # Decode batches of 1-4 rows: the kernel that streams the weight with prefetches (csrc/gemv.c);
    # its results are the GEMM's bit for bit, so a row never changes with the batch around it.
    gemv = m <= GEMV_MAX_ROWS
    fn = lib.tidal_gemv_panels if gemv else lib.tidal_gemm_panels
    rc = fn(x.data_ptr(), x.stride(0) if m > 1 else k, packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
            out.data_ptr(), n, m, n, k, _KINDS[packed.dtype])
    if rc != 0:
        raise RuntimeError(f"{'tidal_gemv_panels' if gemv else 'tidal_gemm_panels'} failed with code {rc}")
    return out
