"""Half-precision CPU kernels: the panel GEMM (panel_gemm.py: fp16 / bf16 weights, and float32
ones on the same path), the half KV cache writes
and the paged decode attention over half caches (csrc/paged_attention.c).

References come from the definitions, in float64, over the half values the kernels hold
(weight.to(dtype), cache.to(dtype)): the kernels must add no error beyond float32 arithmetic.
Rounding on write is checked bit for bit against torch's `.to(dtype)`.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tidal.worker import cpu_kernels as ck
from tidal.worker import panel_gemm as hg

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler: kernels unavailable")

HALF = [torch.float16, torch.bfloat16]
PANEL_DTYPES = [torch.float32, *HALF]


# ----------------------------------------------------------------------------- GEMM
@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=["f32", "fp16", "bf16"])
@pytest.mark.parametrize("n,k", [(17, 13), (48, 64), (1000, 520), (5, 300), (16, 1)])
def test_panel_linear_matches_float64_reference(dtype: torch.dtype, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n * 1000 + k)
    weight = torch.randn(n, k, generator=gen) * 0.1
    bias = torch.randn(n, generator=gen)
    packed = hg.pack_weight(weight, dtype)
    w64 = weight.to(dtype).double()  # the values the kernel holds
    # 0 rows; 1-6 rows (one tile); uneven tiles; several tiles; more rows than one block at K=520
    for m in (0, 1, 3, 5, 6, 7, 16, 33, 100, 130 if k == 520 else 9):
        wide = torch.randn(m, k + 3, generator=gen)
        x = wide[:, 2: 2 + k]  # strided rows (row stride k + 3), last dim contiguous
        for b in (None, bias):
            want = x.double() @ w64.T + (0 if b is None else b.double())
            got = hg.panel_linear(x, packed, n, k, b)
            assert got.shape == (m, n) and got.dtype == torch.float32
            torch.testing.assert_close(got.double(), want, atol=2e-5 * math.sqrt(k), rtol=1e-5)


@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=["f32", "fp16", "bf16"])
def test_panel_linear_rows_do_not_depend_on_the_batch(dtype: torch.dtype) -> None:
    """A row's result is bit-identical whatever else is in the batch (tile heights 1-6, several
    panels per tile, row blocks, one or two threads): a request's tokens do not change with load."""
    gen = torch.Generator().manual_seed(5)
    n, k = 200, 520  # 12 full panels and a partial one; 130+ rows span two row blocks at this K
    weight, bias = torch.randn(n, k, generator=gen) * 0.1, torch.randn(n, generator=gen)
    packed = hg.pack_weight(weight, dtype)
    x = torch.randn(140, k, generator=gen)
    whole = hg.panel_linear(x, packed, n, k, bias)
    for lo, hi in ((0, 1), (3, 4), (0, 2), (5, 8), (0, 7), (10, 16), (0, 33), (100, 140)):
        assert torch.equal(hg.panel_linear(x[lo:hi], packed, n, k, bias), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=["f32", "fp16", "bf16"])
def test_panel_linear_does_not_depend_on_the_thread_count(dtype: torch.dtype) -> None:
    """Bit-identical results with 1 thread and with more threads than cores (threads lose their
    core mid-region, so tasks are taken from the back of others' spans, see work_share.h), also
    with more threads than tasks (spans that own nothing)."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1000, 520  # 63 panels: 16 panel groups; 200 rows: 3 row blocks at this K
    weight, bias = torch.randn(n, k, generator=gen) * 0.1, torch.randn(n, generator=gen)
    packed = hg.pack_weight(weight, dtype)
    x = torch.randn(200, k, generator=gen)
    saved, lib = torch.get_num_threads(), ck.cpu_kernels()

    def set_threads(threads: int) -> None:  # torch's and the kernels' OpenMP (one runtime, usually)
        torch.set_num_threads(threads)
        lib.tidal_set_num_threads(threads)

    try:
        set_threads(1)
        want = [hg.panel_linear(x[:m], packed, n, k, bias) for m in (1, 8, 200)]
        for threads in (2, 3, 7, 64):
            set_threads(threads)
            for _ in range(3):
                got = [hg.panel_linear(x[:m], packed, n, k, bias) for m in (1, 8, 200)]
                assert all(torch.equal(g, w) for g, w in zip(got, want)), threads
    finally:
        set_threads(saved)


def test_panel_linear_edge_shapes_and_errors() -> None:
    w = torch.randn(20, 8)
    packed = hg.pack_weight(w, torch.float16)
    # a row of stride 0 (expand) and a column-strided x are copied, not misread
    x = torch.randn(1, 8).expand(4, 8)
    torch.testing.assert_close(hg.panel_linear(x, packed, 20, 8), (x.double() @ w.half().double().T).float())
    xt = torch.randn(8, 3).T
    torch.testing.assert_close(hg.panel_linear(xt, packed, 20, 8), (xt.double() @ w.half().double().T).float())
    # K = 0: the empty sum, plus bias
    empty = hg.pack_weight(torch.zeros(5, 0), torch.bfloat16)
    assert hg.unpack_weight(empty, 5, 0).shape == (5, 0)
    bias = torch.arange(5.0)
    assert torch.equal(hg.panel_linear(torch.zeros(3, 0), empty, 5, 0, bias), bias.expand(3, 5))
    with pytest.raises(ValueError):
        hg.panel_linear(torch.randn(8), packed, 20, 8)  # 1-D
    with pytest.raises(ValueError):
        hg.panel_linear(torch.randn(2, 9), packed, 20, 8)  # wrong K
    with pytest.raises(ValueError):
        hg.panel_linear(torch.randn(2, 8), packed, 33, 8)  # packed for another N (3 panels, not 2)
    with pytest.raises(ValueError):
        hg.panel_linear(torch.randn(2, 8), packed, 20, 8, torch.randn(19))
    with pytest.raises(ValueError):
        hg.pack_weight(w, torch.float64)
    lib = ck.cpu_kernels()
    out = torch.empty(2, 20)
    assert lib.tidal_gemm_panels(0, 8, ck.ptr(packed), None, ck.ptr(out), 20, -1, 20, 8, 1) == -1
    assert lib.tidal_gemm_panels(ck.ptr(out), 4, ck.ptr(packed), None, ck.ptr(out), 20, 2, 20, 8, 1) == -1
    assert lib.tidal_gemm_panels(ck.ptr(out), 8, ck.ptr(packed), None, ck.ptr(out), 20, 2, 20, 8, 3) == -1  # kind


@pytest.mark.parametrize("dtype", PANEL_DTYPES, ids=["f32", "fp16", "bf16"])
@pytest.mark.parametrize("src", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_round_trip_and_layout(dtype: torch.dtype, src: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(37, 11, generator=gen) * 1000).to(src)
    packed = hg.pack_weight(weight, dtype)
    assert packed.dtype == dtype and packed.shape == (3, 11, 16)
    assert torch.equal(hg.unpack_weight(packed, 37, 11), weight.to(dtype))
    # the layout the C kernel reads: slot s of panel p, row k, holds column 16 p + c
    want = weight.to(dtype)
    for p, kk, s in ((0, 0, 0), (0, 3, 1), (1, 10, 9), (1, 5, 14), (2, 2, 4)):
        c = s if dtype != torch.bfloat16 else (s // 2 if s % 2 == 0 else 8 + s // 2)
        assert packed[p, kk, s] == want[16 * p + c, kk]
    for s in range(16):  # the last panel's 11 padding columns are zero
        c = s if dtype != torch.bfloat16 else (s // 2 if s % 2 == 0 else 8 + s // 2)
        if 32 + c >= 37:
            assert torch.all(packed[2, :, s] == 0)


# ----------------------------------------------------------------------------- KV cache writes
def _awkward_values(dtype: torch.dtype) -> torch.Tensor:
    """Ties (to even, both ways), subnormals, overflow, infinities, signed zero and NaN."""
    if dtype == torch.float16:
        u = 2.0**-10  # fp16 spacing at 1
        special = [1 + u / 2, 1 + 3 * u / 2, -(1 + u / 2), 2.0**-25, 3 * 2.0**-25, 2.0**-24 * 1.5, 2.0**-26,
                   65504.0, 65519.0, 65520.0, -65520.0, 1e6, 6e-8, 1e-10, 2.0**-14 * (1 - 2.0**-11)]
    else:
        u = 2.0**-7  # bf16 spacing at 1
        special = [1 + u / 2, 1 + 3 * u / 2, -(1 + u / 2), 3.4028234663852886e38, 3.39e38, 1e-40, 1e-45,
                   2.0**-126 * (1 + 2.0**-8)]
    special += [math.inf, -math.inf, math.nan, -math.nan, 0.0, -0.0, 1.0, -2.5]
    return torch.tensor(special, dtype=torch.float32)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_write_kv_cache_rounds_like_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    heads, head_dim, tokens = 3, 7, 12  # row of 21: vector chunks of 8 and a tail
    row = heads * head_dim
    values = torch.cat([_awkward_values(dtype), torch.randn(tokens * row * 2, generator=gen) * 100])
    fused = values[: tokens * row * 2].view(tokens, 2 * row + 0)
    wide = torch.zeros(tokens, 2 * row + 5)
    wide[:, :2 * row] = fused
    k, v = wide[:, :row], wide[:, row + 1: 2 * row + 1]  # strided rows
    slots = torch.tensor([3, -1, 0, 9, 12, -1, 1, 2, 4, 5, 6, 7])
    k_cache = torch.full((13, row), 7.0).to(dtype)
    v_cache = torch.full((13, row), 7.0).to(dtype)
    write = getattr(ck.cpu_kernels(), "tidal_write_kv_cache_" + ("f16" if dtype == torch.float16 else "bf16"))
    rc = write(ck.ptr(k), k.stride(0), ck.ptr(v), v.stride(0), ck.ptr(slots), tokens, ck.ptr(k_cache),
               ck.ptr(v_cache), 13, row)
    assert rc == 0
    want_k, want_v = torch.full((13, row), 7.0).to(dtype), torch.full((13, row), 7.0).to(dtype)
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want_k[s], want_v[s] = k[t].to(dtype), v[t].to(dtype)
    for got, want in ((k_cache, want_k), (v_cache, want_v)):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)  # NaN stays NaN
        assert torch.equal(got.view(torch.int16)[~nan], want.view(torch.int16)[~nan])  # bit for bit
    assert torch.isinf(k_cache[3]).any()  # the overflow cases were in the first row
    before = k_cache.clone()
    bad = torch.tensor([0] * 11 + [13])
    assert write(ck.ptr(k), k.stride(0), ck.ptr(v), v.stride(0), ck.ptr(bad), tokens, ck.ptr(k_cache),
                 ck.ptr(v_cache), 13, row) == -1
    assert torch.equal(k_cache.view(torch.int16), before.view(torch.int16))  # nothing written


# ----------------------------------------------------------------------------- paged decode attention
def _decode(dtype: torch.dtype, k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor,
            tables: torch.Tensor, lens: torch.Tensor, scale: float) -> tuple[int, torch.Tensor]:
    suffix = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
    num_blocks, block_size, kv_heads, head_dim = k_cache.shape
    out = torch.full_like(q, math.nan)
    rows = torch.arange(q.shape[0])
    rc = getattr(ck.cpu_kernels(), "tidal_paged_decode_attention_" + suffix)(
        ck.ptr(q), q.stride(0), ck.ptr(out), out.stride(0), ck.ptr(rows), q.shape[0], ck.ptr(k_cache),
        ck.ptr(v_cache), num_blocks, ck.ptr(tables), tables.shape[1], ck.ptr(lens), q.shape[0], q.shape[1],
        kv_heads, head_dim, block_size, scale)
    return rc, out


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (6, 1, 80), (4, 2, 24), (2, 2, 13)])
@pytest.mark.parametrize("block_size", [1, 16])
def test_paged_decode_over_half_cache(dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int,
                                      block_size: int) -> None:
    rng = random.Random(head_dim + block_size)
    gen = torch.Generator().manual_seed(head_dim)
    lens = [1, block_size, block_size + 1, 3 * block_size, 70, 33]
    need = [-(-n // block_size) for n in lens]
    num_blocks = sum(need) + 2
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.long)
    for i, nb in enumerate(need):
        tables[i, :nb] = torch.tensor(ids[:nb])
        ids = ids[nb:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache = (torch.randn(shape, generator=gen) * 2).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(len(lens), heads, head_dim, generator=gen)
    scale = head_dim**-0.5
    rc, got = _decode(dtype, k_cache, v_cache, q, tables, torch.tensor(lens), scale)
    assert rc == 0
    flat_k = k_cache.double().view(-1, kv_heads, head_dim)
    flat_v = v_cache.double().view(-1, kv_heads, head_dim)
    want = torch.empty(q.shape, dtype=torch.float64)
    for i, n in enumerate(lens):
        slots = [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n)]
        for h in range(heads):
            j = h // (heads // kv_heads)
            probs = torch.softmax(flat_k[slots, j] @ q[i, h].double() * scale, 0)
            want[i, h] = probs @ flat_v[slots, j]
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    # the float32 kernel over the widened cache computes the same thing
    _, f32 = _decode(torch.float32, k_cache.float(), v_cache.float(), q, tables, torch.tensor(lens), scale)
    torch.testing.assert_close(got, f32, atol=2e-6, rtol=0)
    bad = tables.clone()
    bad[1, 0] = num_blocks  # a block outside the pool
    assert _decode(dtype, k_cache, v_cache, q, bad, torch.tensor(lens), scale)[0] == -2
