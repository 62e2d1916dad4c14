"""fused_experts_triton (worker/layers/fused_moe_triton.py) against a float64 loop over tokens
and their top-k experts: under the Triton interpreter on CPU, or compiled on a CUDA device when
one is present. TRITON_INTERPRET is set before triton is first imported (it decides at
decoration time); TIDAL_TRITON_TESTS_INTERPRET=1 forces the interpreter on a GPU machine."""

from __future__ import annotations

import os

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TIDAL_TRITON_TESTS_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEV = torch.device("cuda" if ON_GPU else "cpu")

import pytest  # noqa: E402

pytest.importorskip("triton", reason="triton is not installed")

from tidal.worker.layers.fused_moe_triton import fused_experts_triton, moe_align_block_size  # noqa: E402

# max |triton - float64 reference| per dtype (inputs ~ N(0, 1), weights ~ N(0, 1 / fan_in)).
ATOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def reference(x, w13, w2, weights, ids, b13=None, b2=None):
    """float64, one token and one expert at a time."""
    x, w13, w2, weights = (t.double() for t in (x, w13, w2, weights))
    b13 = None if b13 is None else b13.double()
    b2 = None if b2 is None else b2.double()
    i = w2.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gu = w13[e] @ x[t] + (0 if b13 is None else b13[e])
            act = torch.nn.functional.silu(gu[:i]) * gu[i:]
            out[t] += weights[t, j] * (w2[e] @ act + (0 if b2 is None else b2[e]))
    return out


def make_case(t, e, k, h, i, dtype, bias, seed=0):
    """Random inputs; expert e - 1 never chosen (it gets no tokens)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=g) / i ** 0.5
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])
    weights = torch.softmax(torch.randn(t, k, generator=g), dim=-1)
    b13 = torch.randn(e, 2 * i, generator=g) * 0.1 if bias else None
    b2 = torch.randn(e, h, generator=g) * 0.1 if bias else None
    cast = lambda v: None if v is None else v.to(dtype)  # noqa: E731
    return cast(x), cast(w13), cast(w2), weights, ids, cast(b13), cast(b2)


def run(case, **kw):
    x, w13, w2, weights, ids, b13, b2 = (None if v is None else v.to(DEV) for v in case)
    out = fused_experts_triton(x, w13, w2, weights, ids, w13_bias=b13, w2_bias=b2, **kw)
    assert out.dtype == x.dtype and out.shape == x.shape
    return out.cpu()


@pytest.mark.parametrize("t,e,k,h,i,dtype,bias", [
    (1, 4, 1, 32, 48, torch.float32, False),
    (5, 4, 2, 32, 48, torch.float32, True),
    (33, 8, 2, 40, 24, torch.float32, False),  # H, I not multiples of 16; several row blocks
    (5, 8, 1, 32, 48, torch.bfloat16, False),
    (33, 4, 2, 32, 48, torch.bfloat16, True),
    (5, 4, 2, 32, 48, torch.float16, False),
])
def test_matches_float64_reference(t, e, k, h, i, dtype, bias):
    case = make_case(t, e, k, h, i, dtype, bias, seed=t * 100 + e)
    want = reference(*case)
    got = run(case)
    err = (got.double() - want).abs().max().item()
    assert err <= ATOL[dtype], f"max err {err} > {ATOL[dtype]}"


def test_blocks_smaller_than_dims():
    """BLOCK_N, BLOCK_K of 16 over H = 40, I = 24: several column blocks and k steps, with a
    partial last one of each."""
    case = make_case(9, 4, 2, 40, 24, torch.float32, True, seed=7)
    err = (run(case, block_sizes=(16, 16, 16)).double() - reference(*case)).abs().max().item()
    assert err <= ATOL[torch.float32]


def test_custom_activation():
    """activation replaces SiluAndMul (gpt-oss passes its clamped SwiGLU)."""
    case = make_case(5, 4, 2, 32, 16, torch.float32, False, seed=3)
    x, w13, w2, weights, ids, _, _ = case
    swap = lambda gu: torch.nn.functional.silu(gu[..., 16:]) * gu[..., :16]  # noqa: E731
    # the same as SiluAndMul on w13 with its gate and up halves swapped
    want = reference(x, torch.cat([w13[:, 16:], w13[:, :16]], dim=1), w2, weights, ids)
    err = (run(case, activation=swap).double() - want).abs().max().item()
    assert err <= ATOL[torch.float32]


def test_align_block_size():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])  # pairs 0..5 = experts 2 0 2 1 0 2; expert 3: none
    sorted_ids, expert_ids, num_valid = moe_align_block_size(ids, 4, 4)
    assert num_valid == 6
    assert sorted_ids.numel() == 6 + 4 * 3 + 2  # upper bound, rounded up to a block
    assert sorted_ids.tolist()[:12] == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert all(v == 6 for v in sorted_ids.tolist()[12:])
    assert expert_ids.tolist() == [0, 1, 2, -1, -1]


def test_no_tokens():
    x = torch.zeros(0, 32, device=DEV)
    out = fused_experts_triton(x, torch.zeros(4, 32, 32, device=DEV), torch.zeros(4, 32, 16, device=DEV),
                               torch.zeros(0, 2, device=DEV), torch.zeros(0, 2, dtype=torch.long, device=DEV))
    assert out.shape == (0, 32)
