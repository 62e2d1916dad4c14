"""The CPU fast paths (C kernels, oneDNN packed GEMM) against straightforward torch references.

References are written from the definitions (float64 softmax attention over each sequence's own
context, HF's RMSNorm/rotate_half formulas, silu(a) * b), never from the code under test.
"""

from __future__ import annotations

import logging
import math
import os
import random

import pytest
import torch
import torch.nn.functional as F

from tidal.protocol.sizing import cdiv
from tidal.worker import cpu_kernels as ck
from tidal.worker.attention_cpu import CpuAttentionBackend
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.attention_torch import TorchAttentionBackend
from tidal.worker.layers.activation import SiluAndMul
from tidal.worker.layers.gemm import PackedWeight, PanelWeight, onednn_gemm_enabled
from tidal.worker.layers.layernorm import RMSNorm
from tidal.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from tidal.worker.layers.qk_norm_rope import QKNormRope
from tidal.worker.layers.rotary import RotaryEmbedding
from tidal.worker.panel_gemm import panel_gemm_available

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler: kernels unavailable")


# ----------------------------------------------------------------------------- paged attention
def _paged_case(lens: list[int], q_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                block_size: int, seed: int) -> dict:
    """A shuffled block pool holding every sequence's context, plus this step's new q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [cdiv(n, block_size) for n in lens]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(len(lens), max(need) + 1, dtype=torch.long)  # a padded column too
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    total = sum(q_lens)
    q = torch.randn(total, heads, head_dim, generator=gen)
    k = torch.randn(total, kv_heads, head_dim, generator=gen)
    v = torch.randn(total, kv_heads, head_dim, generator=gen)
    qsl, slots = [0], []
    for i, (n, ql) in enumerate(zip(lens, q_lens)):
        qsl.append(qsl[-1] + ql)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n - ql, n)]
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, tables=tables, qsl=qsl,
                slots=torch.tensor(slots), lens=lens, block_size=block_size)


def _reference(case: dict, scale: float) -> torch.Tensor:
    """Per sequence, in float64: write the new K/V, read the context back position by position,
    causal softmax attention, GQA by head // group."""
    q, k, v = case["q"].double(), case["k"].double(), case["v"].double()
    kc, vc = case["k_cache"].double().clone(), case["v_cache"].double().clone()
    bs, heads, kv_heads = case["block_size"], q.shape[1], k.shape[1]
    flat_k, flat_v = kc.view(-1, kv_heads, k.shape[2]), vc.view(-1, kv_heads, k.shape[2])
    flat_k[case["slots"]], flat_v[case["slots"]] = k, v
    out = torch.empty_like(q)
    for i, n in enumerate(case["lens"]):
        s, e = case["qsl"][i], case["qsl"][i + 1]
        slots = [int(case["tables"][i, p // bs]) * bs + p % bs for p in range(n)]
        ctx_k, ctx_v = flat_k[slots], flat_v[slots]  # [n, KVH, D]
        for h in range(heads):
            j = h // (heads // kv_heads)
            scores = q[s:e, h] @ ctx_k[:, j].T * scale  # [q_len, n]
            q_pos = torch.arange(n - (e - s), n)[:, None]
            scores = scores.masked_fill(torch.arange(n)[None, :] > q_pos, -math.inf)
            out[s:e, h] = torch.softmax(scores, -1) @ ctx_v[:, j]
    return out


def _run_backend(backend: TorchAttentionBackend, case: dict, scale: float) -> torch.Tensor:
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    meta = AttentionMetadata.build(case["slots"], case["qsl"], case["lens"], case["tables"], case["block_size"])
    return backend.forward(case["q"], case["k"], case["v"], kc, vc, meta, scale)


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (4, 4, 128), (6, 1, 80), (4, 2, 24)])
@pytest.mark.parametrize("block_size", [1, 5, 16])
def test_paged_decode_matches_reference(heads: int, kv_heads: int, head_dim: int, block_size: int) -> None:
    # lengths: 1 token, exact block multiples, one past, long; 24 is a head_dim with no
    # specialized loop (the generic path)
    lens = [1, block_size, block_size + 1, 3 * block_size, 70, 33]
    case = _paged_case(lens, [1] * len(lens), heads, kv_heads, head_dim, block_size, seed=head_dim + block_size)
    scale = head_dim**-0.5
    want = _reference(case, scale)
    got = _run_backend(CpuAttentionBackend(), case, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=0)
    # and the torch backend (what GPUs and non-float32 caches run) agrees with both
    torch.testing.assert_close(_run_backend(TorchAttentionBackend(), case, scale).double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("num_decodes", [1, 3, 40])  # fewer decodes than threads split kv heads
def test_paged_decode_mixed_with_prefills(num_decodes: int) -> None:
    rng = random.Random(num_decodes)
    lens, q_lens = [], []
    for i in range(num_decodes):
        lens.append(rng.randint(1, 90))
        q_lens.append(1)
        if i % 2 == 0:  # a prefill chunk between decodes, half of them on cached context
            n = rng.randint(2, 40)
            lens.append(n + (rng.randint(1, 30) if i % 4 == 0 else 0))
            q_lens.append(n)
    case = _paged_case(lens, q_lens, 8, 2, 64, 16, seed=num_decodes)
    got = _run_backend(CpuAttentionBackend(), case, 0.125)
    torch.testing.assert_close(got.double(), _reference(case, 0.125), atol=2e-5, rtol=0)


def test_paged_decode_rejects_bad_block_tables() -> None:
    case = _paged_case([20, 9], [1, 1], 4, 2, 64, 4, seed=1)
    case["tables"][1, 1] = case["k_cache"].shape[0]  # one past the pool
    with pytest.raises(RuntimeError, match="out of range"):
        _run_backend(CpuAttentionBackend(), case, 0.1)
    case["tables"][1, 1] = -1
    with pytest.raises(RuntimeError, match="out of range"):
        _run_backend(CpuAttentionBackend(), case, 0.1)
    rows = _paged_case([20, 9], [1, 1], 4, 2, 64, 4, seed=1)
    meta = AttentionMetadata.build(rows["slots"], rows["qsl"], rows["lens"], rows["tables"], 4)
    meta.paged_decode.rows[1] = 2  # one past the two query rows
    with pytest.raises(RuntimeError, match="out of range"):
        CpuAttentionBackend().forward(rows["q"], rows["k"], rows["v"], rows["k_cache"], rows["v_cache"], meta, 0.1)
    short = _paged_case([20, 9], [1, 1], 4, 2, 64, 4, seed=1)
    short["tables"] = short["tables"][:, :2]  # seq 0 needs 5 blocks; its row holds 2
    with pytest.raises(RuntimeError, match="out of range"):
        _run_backend(CpuAttentionBackend(), short, 0.1)


def test_non_float32_falls_back_to_torch() -> None:
    case = _paged_case([17, 5], [1, 1], 4, 2, 64, 4, seed=2)
    for key in ("q", "k", "v", "k_cache", "v_cache"):
        case[key] = case[key].to(torch.bfloat16)
    got = _run_backend(CpuAttentionBackend(), case, 0.125)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), _reference(case, 0.125), atol=3e-2, rtol=0)


# ----------------------------------------------------------------------------- elementwise
def _hf_rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("rows,dim", [(1, 512), (7, 96), (300, 1000), (0, 64)])
def test_rms_norm(rows: int, dim: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    norm = RMSNorm(dim, eps=1e-5)
    norm.weight.data = torch.rand(dim, generator=gen) + 0.5
    x = torch.randn(rows, dim, generator=gen) * 3
    res = torch.randn(rows, dim, generator=gen)
    torch.testing.assert_close(norm(x), _hf_rms(x, norm.weight, 1e-5), atol=1e-5, rtol=1e-5)
    want_res = x + res
    want = _hf_rms(want_res, norm.weight, 1e-5)
    x_in, res_in = x.clone(), res.clone()
    got, got_res = norm(x_in, res_in)
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)  # one float add: exact
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if rows:  # vLLM's contract: the residual form works in place on the caller's tensors
        assert got.data_ptr() == x_in.data_ptr() and got_res.data_ptr() == res_in.data_ptr()


def test_silu_and_mul_including_extremes() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(33, 2 * 300, generator=gen) * 4
    x[0, :6] = torch.tensor([0.0, -100.0, 100.0, -88.5, 88.5, 1e-30])
    want = F.silu(x[:, :300]) * x[:, 300:]
    torch.testing.assert_close(SiluAndMul()(x), want, atol=1e-5, rtol=1e-5)
    three_d = x.view(3, 11, 600)
    torch.testing.assert_close(SiluAndMul()(three_d), want.view(3, 11, 300), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64}])
def test_qk_norm_rope_in_place(qk_norm: bool, scaling: dict | None) -> None:
    heads, kv_heads, head_dim, tokens = 6, 2, 32, 19
    rope = RotaryEmbedding(head_dim, head_dim, 512, 10000.0, scaling)
    layer = QKNormRope(rope, heads, kv_heads, 1e-6 if qk_norm else None)
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    positions = torch.randint(0, 512, (tokens,), generator=gen)
    q_w = k_w = None
    if layer.q_norm is not None and layer.k_norm is not None:
        q_w = layer.q_norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5
        k_w = layer.k_norm.weight.data = torch.rand(head_dim, generator=gen) + 0.5
    # reference: HF order (per-head RMSNorm, then x*cos + rotate_half(x)*sin with full-width tables)
    q, k, v = qkv.view(tokens, -1, head_dim).split([heads, kv_heads, kv_heads], dim=1)
    if qk_norm:
        q, k = _hf_rms(q, q_w, 1e-6), _hf_rms(k, k_w, 1e-6)
    cos = torch.cat([rope.cos_cache[positions]] * 2, -1)[:, None]
    sin = torch.cat([rope.sin_cache[positions]] * 2, -1)[:, None]

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., head_dim // 2:], x[..., : head_dim // 2]), -1)

    want = torch.cat([q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v], 1).view(tokens, -1)
    wide = torch.zeros(tokens, qkv.shape[1] + 8)
    wide[:, :qkv.shape[1]] = qkv
    view = wide[:, :qkv.shape[1]]  # row stride != width, as a fused projection's slice
    q_out, k_out, v_out = layer(positions, view)
    torch.testing.assert_close(view, want, atol=2e-5, rtol=1e-5)  # the fused kernel ran, in place
    assert torch.equal(torch.cat([q_out, k_out, v_out], 1), view)
    assert torch.equal(wide[:, qkv.shape[1]:], torch.zeros(tokens, 8))  # nothing past the view
    with pytest.raises(IndexError, match="outside"):
        layer(torch.full((tokens,), 512), view)
    # The torch path (kernels off: what GPUs and other dtypes run) computes the same.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CPU_KERNELS", "0")
        ck.cpu_kernels.cache_clear()
        try:
            torch_out = torch.cat(layer(positions, qkv.clone()), 1)
        finally:
            ck.cpu_kernels.cache_clear()
    torch.testing.assert_close(torch_out, want, atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- GEMM
@pytest.mark.parametrize("gemm", ["auto", "onednn"])
@pytest.mark.parametrize("rows", [0, 1, 5, 64, 1000])
def test_packed_linear_layers_match_f_linear(rows: int, gemm: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linear layers after packing (auto: the panel GEMM where built; onednn) equal F.linear."""
    monkeypatch.setenv("TIDAL_CPU_GEMM", gemm)
    if gemm == "onednn" and not onednn_gemm_enabled(torch.empty(2, 2)):
        pytest.skip("no oneDNN packed GEMM in this torch")
    gen = torch.Generator().manual_seed(rows)
    col = ColumnParallelLinear(96, 200, bias=True)
    row = RowParallelLinear(200, 96, bias=True)
    for layer in (col, row):
        layer.weight.data = torch.randn(layer.weight.shape, generator=gen) * 0.1
        layer.bias.data = torch.randn(layer.bias.shape, generator=gen)
    dense = [(layer.weight.clone(), layer.bias.clone()) for layer in (col, row)]
    x = torch.randn(rows, 96, generator=gen)
    want = F.linear(F.linear(x, *dense[0]), *dense[1])
    for layer in (col, row):
        layer.process_weights_after_loading()
        assert layer.weight is None and layer.packed_weight is not None  # held once, packed
        kind = PackedWeight if gemm == "onednn" or not panel_gemm_available(torch.float32) else PanelWeight
        assert type(layer.packed_weight) is kind
    torch.testing.assert_close(row(col(x)), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(col.packed_weight.to_dense(), dense[0][0], atol=0, rtol=0)


def test_packed_gemms_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIDAL_CPU_GEMM", "torch")
    layer = ColumnParallelLinear(8, 8)
    layer.weight.data = torch.eye(8)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and torch.equal(layer(torch.ones(2, 8)), torch.ones(2, 8))


# ----------------------------------------------------------------------------- build and fallbacks
def test_build_is_cached_and_falls_back_without_a_compiler(
    monkeypatch: pytest.MonkeyPatch, tmp_path: object, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("TIDAL_CACHE_DIR", str(tmp_path))
    ck.cpu_kernels.cache_clear()
    try:
        assert ck.cpu_kernels() is not None
        (built,) = (tmp_path / "kernels").iterdir()  # type: ignore[operator]
        stamp = built.stat().st_mtime_ns
        ck.cpu_kernels.cache_clear()
        assert ck.cpu_kernels() is not None and built.stat().st_mtime_ns == stamp  # reused, not rebuilt
        assert os.listdir(tmp_path / "kernels") == [built.name]  # type: ignore[operator]

        monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
        ck.cpu_kernels.cache_clear()
        with caplog.at_level(logging.WARNING, logger="tidal.worker.cpu_kernels"):
            assert ck.cpu_kernels() is None
        assert "using torch ops" in caplog.text
        # every fast path then runs its torch twin and still computes the same thing
        x = torch.randn(4, 64)
        norm = RMSNorm(64)
        torch.testing.assert_close(norm(x), _hf_rms(x, norm.weight, 1e-6))
        case = _paged_case([9, 30], [1, 1], 4, 2, 64, 4, seed=5)
        torch.testing.assert_close(_run_backend(CpuAttentionBackend(), case, 0.1).double(),
                                   _reference(case, 0.1), atol=2e-5, rtol=0)

        monkeypatch.delenv("CC")
        monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
        ck.cpu_kernels.cache_clear()
        assert ck.cpu_kernels() is None
    finally:
        ck.cpu_kernels.cache_clear()


# ----------------------------------------------------------------------------- inputs the kernels refuse
def test_misfit_inputs_take_the_torch_path_and_fail_or_agree_like_torch() -> None:
    """Shapes, dtypes and layouts a kernel would misread are routed to the torch ops, which
    raise (or compute) exactly as they would without the kernels; nothing reads out of bounds."""
    norm = RMSNorm(64)
    with pytest.raises(RuntimeError, match="size of tensor"):
        norm(torch.randn(2, 256))  # weight narrower than the rows
    x, res = torch.randn(3, 64), torch.randn(3, 64, dtype=torch.bfloat16)
    out, new_res = norm(x, res)  # a bf16 residual: torch promotes, the kernel would misread it
    torch.testing.assert_close(new_res, x + res)
    with pytest.raises(RuntimeError):
        SiluAndMul()(torch.randn(3, 5))  # odd width: torch's shape error, not a strided misread

    rope = RotaryEmbedding(64, 64, 128, 10000.0)
    qkv = torch.randn(8, (4 + 2 * 2) * 64)
    before = qkv.clone()
    with pytest.raises(RuntimeError):
        QKNormRope(rope, 4, 2, None)(torch.arange(1), qkv)  # 1 position, 8 rows
    with pytest.raises(RuntimeError):
        QKNormRope(rope, 4, 2, None)(torch.arange(8), qkv[:, :256])  # q only
    narrow_norms = QKNormRope(rope, 4, 2, 1e-6)
    narrow_norms.q_norm.weight.data = narrow_norms.k_norm.weight.data = torch.ones(32)  # type: ignore[union-attr]
    with pytest.raises(RuntimeError):
        narrow_norms(torch.arange(8), qkv)
    assert torch.equal(qkv, before)  # the kernel never touched it

    case = _paged_case([17, 5], [1, 1], 4, 2, 64, 4, seed=7)
    case["v_cache"] = case["v_cache"].to(torch.bfloat16)  # only V in bf16: the kernel reads float32
    assert not CpuAttentionBackend().supports(case["q"], case["k_cache"], case["v_cache"])


def test_kernel_with_no_decodes_is_a_no_op() -> None:
    lib = ck.cpu_kernels()
    out = torch.full((2, 4, 8), 7.0)
    empty = torch.zeros(0, dtype=torch.long)
    cache = torch.zeros(1, 4, 2, 8)
    rc = lib.tidal_paged_decode_attention_f32(
        ck.ptr(out), 32, ck.ptr(out), 32, ck.ptr(empty), 2, ck.ptr(cache), ck.ptr(cache), 1, ck.ptr(empty), 0,
        ck.ptr(empty), 0, 4, 2, 8, 4, 1.0)
    assert rc == 0 and torch.equal(out, torch.full((2, 4, 8), 7.0))


def test_kv_cache_write_skips_padding_and_rejects_bad_slots() -> None:
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 3 * 2 * 8, generator=gen)  # k and v as strided views of a fused row
    k, v = qkv[:, 16:32].view(5, 2, 8), qkv[:, 32:].view(5, 2, 8)
    flat_k, flat_v = torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)

    def meta(slots: list[int]) -> AttentionMetadata:
        return AttentionMetadata.build(torch.tensor(slots), [0, 5], [5], torch.zeros(1, 1, dtype=torch.long), 16)

    CpuAttentionBackend()._write_cache(k, v, flat_k, flat_v, meta([3, -1, 0, 9, -1]))
    want_k, want_v = torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)
    for token, slot in ((0, 3), (2, 0), (3, 9)):
        want_k[slot], want_v[slot] = k[token], v[token]
    assert torch.equal(flat_k, want_k) and torch.equal(flat_v, want_v)
    with pytest.raises(RuntimeError, match="outside"):
        CpuAttentionBackend()._write_cache(k, v, flat_k, flat_v, meta([1, 2, 10, 4, 5]))
    assert torch.equal(flat_k, want_k)  # nothing written
