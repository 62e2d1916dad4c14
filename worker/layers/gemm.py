"""Dense GEMM for linear layers on CPUs: tidal's panel GEMM, oneDNN with weights packed once, or
`F.linear`.

torch's CPU `F.linear` in float32 goes to MKL, which on this project's AMD (Zen 4) machines is
slow for the small row counts of decode steps: 36-40 GFLOPS at 4 rows, ~140 at 32, ~175 at 4096.
oneDNN with the weight reordered once into its blocked layout gives 105-157, ~200 and ~215 on
the same shapes, but builds a primitive for every new row count: a cold batch meets a new one
almost every step (hence the row buckets below) and the primitive cache grows. tidal's own
kernel (PanelWeight, worker/panel_gemm.py, csrc/gemm_panels.c) builds nothing per shape and
measured faster still on the offline workload (the forward 3.8 s -> 3.0 s), so float32 weights
go there wherever its vectorized (AVX2/FMA/F16C) path is compiled, to oneDNN elsewhere.

Half-precision weights (dtype float16 / bfloat16 on CPU) always go to the panel GEMM: oneDNN has
no fp16/bf16 GEMM for AVX2-only CPUs, and decode steps are bound by the bytes of weight they
read, which half storage halves. Activations stay float32; TIDAL_CPU_HALF_WEIGHTS=0 runs such
models in torch's half ops instead.

TIDAL_CPU_GEMM=onednn puts float32 weights on oneDNN, =torch on `F.linear`. oneDNN's row counts
are padded to buckets (gemm_bucket; TIDAL_CPU_GEMM_BUCKETS=0 turns that off) and its decode-size
buckets are built at start-up (warm_up_gemm_buckets), so a cold batch runs as fast as a warm one
and its primitive cache stops growing.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

from tidal.protocol import envs
from tidal.worker.panel_gemm import pack_weight, panel_gemm_available, run_panel_gemm, unpack_weight

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


def _cpu_gemm_choice() -> str:
    choice = envs.TIDAL_CPU_GEMM
    if choice not in ("auto", "onednn", "torch"):
        raise ValueError(f"TIDAL_CPU_GEMM={choice!r}: expected auto, onednn or torch")
    return choice


def onednn_gemm_enabled(weight: torch.Tensor) -> bool:
    """oneDNN can take this weight (and TIDAL_CPU_GEMM allows it)."""
    if _cpu_gemm_choice() == "torch":
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
        self.bucketed = envs.TIDAL_CPU_GEMM_BUCKETS  # read once: linear() runs per layer per step

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")

    def to_dense(self) -> torch.Tensor:
        return self.packed.to_dense()


_HALF_DTYPES = (torch.float16, torch.bfloat16)


def half_storage_enabled(dtype: torch.dtype, device: torch.device | str) -> bool:
    """A model in `dtype` on `device` keeps its weights (and KV cache) in half precision but
    computes in float32: CPU, fp16/bf16, and the panel GEMM built. The loader decides once per
    model (worker/loader.py), so every layer agrees on the activations' dtype."""
    if torch.device(device).type != "cpu" or dtype not in _HALF_DTYPES or not envs.TIDAL_CPU_HALF_WEIGHTS:
        return False
    return panel_gemm_available(dtype)


def panel_gemm_enabled(weight: torch.Tensor) -> bool:
    """The weight goes to tidal's own GEMM (worker/panel_gemm.py): half weights under
    half_storage_enabled; float32 ones with TIDAL_CPU_GEMM=auto where the kernel's vectorized
    path is built."""
    if weight.dim() != 2 or weight.device.type != "cpu":
        return False
    if weight.dtype in _HALF_DTYPES:
        return half_storage_enabled(weight.dtype, weight.device)
    if weight.dtype != torch.float32 or _cpu_gemm_choice() != "auto":
        return False
    return panel_gemm_available(torch.float32)


class PanelWeight:
    """A [out, in] weight (float32, fp16 or bf16) in the panel GEMM's layout; `linear(x, bias)`
    takes and returns float32 and equals `F.linear(x, weight.float(), bias)` up to summation
    order. No row buckets: the kernel builds nothing per shape."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.shape = tuple(weight.shape)
        self.dtype = weight.dtype
        self.packed = pack_weight(weight.detach(), weight.dtype)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        n, k = self.shape
        if x.dim() != 2:  # the model runs [tokens, features]; anything else is rare
            return self.linear(x.reshape(-1, k), bias).view(*x.shape[:-1], n)
        if x.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
            raise TypeError(f"panel GEMMs compute in float32; got x {x.dtype}, bias "
                            f"{None if bias is None else bias.dtype}")
        if x.shape[1] != k:
            raise ValueError(f"expected an input of shape [M, {k}], got {tuple(x.shape)}")
        return run_panel_gemm(x, self.packed, n, k, bias)  # the packed weight is ours: checked

    def to_dense(self) -> torch.Tensor:
        return unpack_weight(self.packed, *self.shape)


def pack_if_enabled(weight: torch.Tensor) -> PackedWeight | PanelWeight | None:
    """The weight in the layout of the fastest GEMM for it, or None to keep `F.linear`."""
    if panel_gemm_enabled(weight):
        return PanelWeight(weight)
    return PackedWeight(weight) if onednn_gemm_enabled(weight) else None


# Row-count buckets of the packed GEMM. oneDNN builds (and keeps) a primitive for every new
# input shape; a cold batch meets a new row count almost every step, and under varied load the
# cache grew by ~750 MB. Rows are padded up to the next bucket: exact up to 16, multiples of 4
# up to _FINE_FROM, then _STEPS_PER_OCTAVE steps per octave (at most 1/_STEPS_PER_OCTAVE extra
# rows). Padding is not free even for decode batches: on this project's 2-core AVX2 machines a
# 9-row GEMM of these models' shapes is already compute bound (16 rows cost 1.7x of 9), hence
# the fine steps where decode batches fall. 84 shapes per weight up to 8192 rows.
_FINE_FROM = 64
_STEPS_PER_OCTAVE = 8


def gemm_bucket(rows: int) -> int:
    """The smallest bucket >= rows (see above)."""
    if rows <= 16:
        return rows
    if rows <= _FINE_FROM:
        return -(-rows // 4) * 4
    octave = 1 << ((rows - 1).bit_length() - 1)  # the power of two below rows
    step = octave // _STEPS_PER_OCTAVE
    return -(-rows // step) * step


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    padded = x.new_empty((rows, *x.shape[1:]))
    padded[: x.shape[0]] = x
    padded[x.shape[0]:].zero_()  # finite rows: their (discarded) products cost no denormal/NaN paths
    return padded


def linear(x: torch.Tensor, weight: torch.Tensor | None, packed: PackedWeight | PanelWeight | None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ W^T (+ bias) with the packed weight when there is one, else the dense one. The packed
    GEMM runs on rows padded to gemm_bucket (TIDAL_CPU_GEMM_BUCKETS=0: exact rows); the padding
    rows' results are dropped, and a row's result does not depend on the other rows."""
    if packed is None:
        return F.linear(x, weight, bias)
    if not isinstance(packed, PackedWeight):  # PanelWeight, Int8Weight: nothing built per row count
        return packed.linear(x, bias)
    rows = x.shape[0] if x.dim() == 2 else 0
    bucket = gemm_bucket(rows) if rows > 0 and packed.bucketed else rows
    if bucket == rows:
        return packed.linear(x, bias)
    return packed.linear(_pad_rows(x, bucket), bias)[:rows]


@torch.inference_mode()
def warm_up_gemm_buckets(model: torch.nn.Module, max_rows: int) -> int:
    """Build, at start-up, the oneDNN primitives of every row bucket up to gemm_bucket(max_rows)
    (the decode batch sizes; max_rows is capped at _WARM_UP_MAX_ROWS), once per distinct weight
    shape: primitives are keyed by shapes, so one layer's warm-up serves every layer of its shape.
    A new user's first batch then builds none for its decode steps. Returns the GEMMs run."""
    seen: set[tuple] = set()
    buckets = sorted({gemm_bucket(m) for m in range(1, min(max_rows, _WARM_UP_MAX_ROWS) + 1)})
    runs = 0
    for module in model.modules():
        packed = getattr(module, "packed_weight", None)
        if not isinstance(packed, PackedWeight) or not packed.bucketed:
            continue
        bias = getattr(module, "bias", None)
        bias = bias if isinstance(bias, torch.Tensor) else None
        key = (packed.shape, packed.dtype, bias is None)
        if key in seen:
            continue
        seen.add(key)
        for rows in buckets:
            linear(torch.zeros(rows, packed.shape[1], dtype=packed.dtype), None, packed, bias)
            runs += 1
    return runs


# Decode batches up to 64 rows: 28 buckets, 640 rows of GEMM per weight shape (0.1-0.3 s of
# start-up on this project's 2-core machines). Bigger batches build their bucket once, later.
_WARM_UP_MAX_ROWS = 64
