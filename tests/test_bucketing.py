"""GEMM row buckets (worker/layers/gemm.py): the bucket function, padded GEMMs against the
unpadded product, start-up warm-up, and greedy tokens identical with and without buckets."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from tidal.worker.layers.gemm import (
    PackedWeight,
    gemm_bucket,
    linear,
    onednn_gemm_enabled,
    warm_up_gemm_buckets,
)

needs_onednn = pytest.mark.skipif(not onednn_gemm_enabled(torch.zeros(8, 8)), reason="no oneDNN packed GEMM")


def test_gemm_bucket_bounds_shapes_and_padding() -> None:
    buckets = [gemm_bucket(m) for m in range(1, 8193)]
    assert all(b >= m for m, b in zip(range(1, 8193), buckets))
    assert buckets == sorted(buckets)  # monotone: a bigger batch never gets a smaller bucket
    assert all(gemm_bucket(b) == b for b in buckets)  # buckets are fixed points
    assert len(set(buckets)) <= 84  # a bounded set of oneDNN primitives per weight shape
    assert [gemm_bucket(m) for m in range(1, 17)] == list(range(1, 17))  # small decode batches: exact
    assert max(gemm_bucket(m) - m for m in range(1, 65)) == 3  # decode batches: at most 3 padding rows
    assert max(gemm_bucket(m) / m for m in range(65, 8193)) <= 1.125  # where GEMMs are compute bound


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_padded_gemm_equals_plain_product(bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen)
    b = torch.randn(48, generator=gen) if bias else None
    bucketed = PackedWeight(w)
    monkeypatch.setenv("TIDAL_CPU_GEMM_BUCKETS", "0")
    exact = PackedWeight(w)
    assert bucketed.bucketed and not exact.bucketed
    for rows in (1, 3, 9, 17, 65, 100, 300):
        x = torch.randn(rows, 64, generator=gen)
        ref = (x.double() @ w.double().T + (b.double() if b is not None else 0)).float()
        got = linear(x, None, bucketed, b)
        assert got.shape == (rows, 48) and got.is_contiguous()
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(got, linear(x, None, exact, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(linear(x, w, None, b), F.linear(x, w, b))  # unpacked: untouched


@needs_onednn
def test_warm_up_runs_each_bucket_once_per_weight_shape() -> None:
    class Lin(torch.nn.Module):
        def __init__(self, out: int, inp: int, bias: bool) -> None:
            super().__init__()
            self.packed_weight = PackedWeight(torch.randn(out, inp))
            self.bias = torch.zeros(out) if bias else None

    model = torch.nn.Sequential(Lin(32, 16, False), Lin(32, 16, False), Lin(32, 16, True), Lin(8, 32, False))
    num_buckets = len({gemm_bucket(m) for m in range(1, 21)})
    # Three distinct (shape, bias) keys; the second layer shares the first one's primitives.
    assert warm_up_gemm_buckets(model, max_rows=20) == 3 * num_buckets


def _greedy_tokens(model: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    llm = LLM(model=model, dtype="float32", max_num_seqs=64, max_num_batched_tokens=512, seed=0)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in max_tokens],
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.shutdown()


@needs_onednn
def test_greedy_tokens_identical_with_and_without_buckets(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch,
                                                         no_leaked_cores: None) -> None:
    rng = random.Random(0)
    # Varied prompt lengths and a batch that shrinks as requests finish: every step meets
    # another row count (prefill chunks, then decode batches from 24 down to 1).
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(1, 90))] for _ in range(24)]
    max_tokens = [rng.randint(1, 24) for _ in prompts]
    monkeypatch.setenv("TIDAL_CPU_GEMM", "onednn")  # float32 weights on oneDNN, where buckets apply
    with_buckets = _greedy_tokens(tiny_model_dir, prompts, max_tokens)
    monkeypatch.setenv("TIDAL_CPU_GEMM_BUCKETS", "0")  # the core process inherits it
    without = _greedy_tokens(tiny_model_dir, prompts, max_tokens)
    assert [len(t) for t in with_buckets] == max_tokens
    assert with_buckets == without
