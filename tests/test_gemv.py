"""The small-batch panel GEMM (csrc/gemv.c, called by panel_gemm.run_panel_gemm for 1-4 rows).

References: the float64 product over the values the kernel holds (weight.to(dtype)), with a
tolerance from float32 accumulation's error bound; and gemm_panels.c, which gemv.c must match
bit for bit (one FMA chain per output in k order on both), so that a row's result never depends
on the batch it runs in, the path that ran it, or the thread count.
"""

from __future__ import annotations

import ctypes

import pytest
import torch

from tidal.worker import cpu_kernels as ck
from tidal.worker import panel_gemm as hg

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler: kernels unavailable")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IDS = ["f32", "fp16", "bf16"]
KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
U32 = 2.0**-24  # float32's unit roundoff


def _call(name: str, x: torch.Tensor, packed: torch.Tensor, n: int, k: int,
          bias: torch.Tensor | None) -> torch.Tensor:
    """One of the C functions on x (rows may be strided) straight through ctypes."""
    m = x.shape[0]
    out = torch.full((m, n), float("nan"))  # every element must be written
    rc = getattr(ck.cpu_kernels(), name)(x.data_ptr(), x.stride(0) if m > 1 else k, packed.data_ptr(),
                                         None if bias is None else bias.data_ptr(), out.data_ptr(), n, m, n, k,
                                         KIND[packed.dtype])
    assert rc == 0, name
    return out


def _gemv(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _call("tidal_gemv_panels", x, packed, n, k, bias)


def _gemm(x: torch.Tensor, packed: torch.Tensor, n: int, k: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _call("tidal_gemm_panels", x, packed, n, k, bias)


def _check_close(got: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None) -> None:
    """|got - exact| within float32 accumulation's bound: a K-term FMA chain and the bias add
    err by at most about (K + 1) u sum |x w| (+ u |result|), here with a 2x margin."""
    want = x.double() @ w64.T + (0 if bias is None else bias.double())
    scale = x.double().abs() @ w64.abs().T + (0 if bias is None else bias.double().abs())
    bound = 2 * (x.shape[1] + 2) * U32 * scale + 1e-30
    err = (got.double() - want).abs()
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), f"error {err.flatten()[worst]:.3g} > bound {bound.flatten()[worst]:.3g}"


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n", [1, 15, 17, 33, 200, 1000])
@pytest.mark.parametrize("k", [1, 15, 17, 33, 1000])
def test_gemv_matches_float64_reference(dtype: torch.dtype, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 7919 + k)
    weight = torch.randn(n, k, generator=gen)
    bias = torch.randn(n, generator=gen)
    packed = hg.pack_weight(weight, dtype)
    w64 = weight.to(dtype).double()  # the values the kernel holds
    for m in (1, 2, 3, 4, 5):  # 5: run_panel_gemm's GEMM path, the row count past gemv's
        wide = torch.randn(m, k + 5, generator=gen)
        x = wide[:, 3: 3 + k]  # strided rows (row stride k + 5), each row contiguous
        for b in (None, bias):
            got = hg.panel_linear(x, packed, n, k, b)
            assert got.shape == (m, n) and got.dtype == torch.float32
            _check_close(got, x, w64, b)
            if m <= hg.GEMV_MAX_ROWS:
                direct = _gemv(x, packed, n, k, b)
                _check_close(direct, x, w64, b)
                assert torch.equal(direct, got)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("n,k", [(1000, 1000), (33, 17), (200, 520), (8192, 64)])
def test_gemv_is_bit_identical_to_the_gemm(dtype: torch.dtype, n: int, k: int) -> None:
    """gemv.c and gemm_panels.c give the same bits for every row count gemv takes."""
    gen = torch.Generator().manual_seed(n + k)
    packed = hg.pack_weight(torch.randn(n, k, generator=gen), dtype)
    bias = torch.randn(n, generator=gen)
    for m in (1, 2, 3, 4):
        x = torch.randn(m, k, generator=gen)
        for b in (None, bias):
            assert torch.equal(_gemv(x, packed, n, k, b), _gemm(x, packed, n, k, b)), (m, b is None)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_rows_do_not_depend_on_the_batch_or_the_run(dtype: torch.dtype) -> None:
    """A row alone, in any batch of 2-4 (gemv) or of 9 (the GEMM), gives the same bits, run after
    run: a request's tokens do not change with the load or from step to step."""
    gen = torch.Generator().manual_seed(3)
    n, k = 1000, 520  # 63 panels: the last tile of a 1-row pass has 3 panels, one partial
    packed = hg.pack_weight(torch.randn(n, k, generator=gen), dtype)
    bias = torch.randn(n, generator=gen)
    x = torch.randn(9, k, generator=gen)
    whole = hg.panel_linear(x, packed, n, k, bias)  # 9 rows: gemm_panels.c
    for lo, hi in ((0, 1), (4, 5), (8, 9), (0, 2), (3, 5), (1, 4), (5, 8), (0, 4), (5, 9)):
        for _ in range(2):
            assert torch.equal(hg.panel_linear(x[lo:hi], packed, n, k, bias), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_gemv_does_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    """Same bits with 1 thread, 2, and more threads than cores or tasks (tasks then move between
    threads, work_share.h): a tile's sums never depend on who runs it."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1000, 1000
    packed = hg.pack_weight(torch.randn(n, k, generator=gen), dtype)
    x = torch.randn(4, k, generator=gen)
    saved, lib = torch.get_num_threads(), ck.cpu_kernels()

    def set_threads(threads: int) -> None:  # torch's and the kernels' OpenMP (one runtime, usually)
        torch.set_num_threads(threads)
        lib.tidal_set_num_threads(threads)

    try:
        set_threads(1)
        want = [_gemv(x[:m], packed, n, k) for m in (1, 2, 3, 4)]
        for threads in (2, 3, 64):
            set_threads(threads)
            got = [_gemv(x[:m], packed, n, k) for m in (1, 2, 3, 4)]
            assert all(torch.equal(g, w) for g, w in zip(got, want)), threads
    finally:
        set_threads(saved)


def test_gemv_edge_cases_and_errors() -> None:
    lib = ck.cpu_kernels()
    packed = hg.pack_weight(torch.randn(20, 8), torch.float16)
    out = torch.zeros(5, 20)
    x = torch.randn(5, 8)
    # k == 0: an empty sum is the bias (or zero)
    empty = hg.pack_weight(torch.zeros(5, 0), torch.bfloat16)
    bias = torch.randn(5)
    assert torch.equal(_gemv(torch.zeros(3, 0), empty, 5, 0, bias), bias.expand(3, 5))
    assert torch.equal(_gemv(torch.zeros(2, 0), empty, 5, 0, None), torch.zeros(2, 5))
    p, o = packed.data_ptr(), out.data_ptr()
    assert lib.tidal_gemv_panels(x.data_ptr(), 8, p, None, o, 20, 0, 20, 8, 1) == 0  # no rows: nothing to do
    assert lib.tidal_gemv_panels(x.data_ptr(), 8, p, None, o, 20, 5, 20, 8, 1) == -1  # 5 rows: the GEMM's
    assert lib.tidal_gemv_panels(x.data_ptr(), 8, p, None, o, 20, -1, 20, 8, 1) == -1
    assert lib.tidal_gemv_panels(x.data_ptr(), 8, p, None, o, 20, 2, 20, 8, 3) == -1  # unknown kind
    assert lib.tidal_gemv_panels(x.data_ptr(), 4, p, None, o, 20, 2, 20, 8, 1) == -1  # row stride < K
    assert lib.tidal_gemv_panels(x.data_ptr(), 8, p, None, o, 19, 2, 20, 8, 1) == -1  # out stride < N
    assert lib.tidal_gemv_panels(None, 8, p, None, o, 20, 2, 20, 8, 1) == -1  # null x
    assert lib.tidal_gemv_panels(x.data_ptr(), 8, None, None, o, 20, 2, 20, 8, 1) == -1  # null weight
    # a row stride below K is fine for one row (it is never used)
    assert lib.tidal_gemv_panels(x.data_ptr(), 0, p, None, o, 20, 1, 20, 8, 1) == 0
    assert lib.tidal_gemv_panels.restype is ctypes.c_int  # typed in cpu_kernels._SIGNATURES
