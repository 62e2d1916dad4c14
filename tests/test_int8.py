"""int8 block weights (quantization="int8"): the kernel against a float64 reference of the
quantized operands, the quantizer against its definition, and a model against its float32 self."""

from __future__ import annotations

import pytest
import torch

from tidal.worker.cpu_kernels import cpu_kernels
from tidal.worker.layers.quantization import (QK, Int8Weight, check_quantization, dequantize_blocks, int8_reference,
                                              quantize_blocks)

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="C kernels not built")


@pytest.mark.parametrize("k", [1, 31, 32, 33, 45, 512])
def test_quantize_blocks_follows_its_definition(k: int) -> None:
    w = torch.randn(7, k, generator=torch.Generator().manual_seed(k)) * 3
    w[0] = 0.0  # an all-zero row: scale 0, q 0
    q, d = quantize_blocks(w)
    kb = -(-k // QK)
    assert q.shape == (7, kb * QK) and d.shape == (7, kb) and q.dtype == torch.int8
    padded = torch.zeros(7, kb * QK)
    padded[:, :k] = w
    amax = padded.view(7, kb, QK).abs().amax(dim=2)
    assert torch.equal(d, amax / 127)
    assert int(q.abs().max()) <= 127 and torch.all(q[:, k:] == 0)
    err = (dequantize_blocks(q, d, k).double() - w.double()).abs().view(7, -1)
    bound = d.double().repeat_interleave(QK, dim=1)[:, :k] * 0.5 * (1 + 1e-5)  # half a step
    assert torch.all(err <= bound)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("n, k", [(1, 1), (37, 45), (64, 512), (100, 33), (19, 1536)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_float64_of_quantized_operands(m: int, n: int, k: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=gen)
    wide = torch.randn(m, k + 7, generator=gen)
    x = wide[:, 3:3 + k]  # rows strided past their length
    bias = torch.randn(n, generator=gen) if with_bias else None
    weight = Int8Weight(w)
    got = weight.linear(x, bias).double()
    ref = int8_reference(*quantize_blocks(x), weight.q, weight.d, bias)
    assert got.shape == (m, n)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max() + 1e-6
    # and the quantized product is near the float one: both operands within half a step
    dense = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert (got - dense).abs().max() <= 0.05 * dense.abs().max() + 1e-3


def test_rows_do_not_depend_on_the_batch() -> None:
    gen = torch.Generator().manual_seed(1)
    weight = Int8Weight(torch.randn(300, 700, generator=gen))
    x = torch.randn(5, 700, generator=gen)
    full = weight.linear(x)
    for i in range(5):
        assert torch.equal(weight.linear(x[i:i + 1])[0], full[i])
    assert torch.equal(weight.linear(x.view(1, 5, 700)).view(5, 300), full)


def test_bad_inputs_are_clear_errors() -> None:
    weight = Int8Weight(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"\[M, 16\]"):
        weight.linear(torch.randn(2, 15))
    with pytest.raises(ValueError, match="float32"):
        weight.linear(torch.randn(2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="bias"):
        weight.linear(torch.randn(2, 16), torch.randn(7))
    with pytest.raises(ValueError, match="2-D"):
        Int8Weight(torch.randn(4))
    with pytest.raises(ValueError, match="awq.*int8"):
        check_quantization("awq", "cpu")
    with pytest.raises(ValueError, match="CPUs only"):
        check_quantization("int8", "cuda")
    check_quantization(None, "cuda")


@pytest.fixture(scope="module")
def greedy_runs(tiny_model_dir: str) -> dict[str | None, list]:
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 500 + 10 for j in range(24)]} for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, prompt_logprobs=0)
    runs: dict[str | None, list] = {}
    for name, dtype, quantization in ((None, "float32", None), ("bf16", "bfloat16", None),
                                      ("int8", "float32", "int8")):
        llm = LLM(model=tiny_model_dir, dtype=dtype, quantization=quantization, max_model_len=256, seed=0)
        try:
            runs[name] = llm.generate(prompts, sp, use_tqdm=False)
        finally:
            llm.shutdown()
    return runs


def _distance(ref: list, got: list) -> tuple[float, float, float]:
    """(mean, max |prompt logprob difference| (teacher-forced: the same tokens for both), share
    of greedy output tokens before the first divergence)."""
    diffs, agree, total = [], 0, 0
    for r_out, g_out in zip(ref, got):
        for a, b, tok in zip(r_out.prompt_logprobs[1:], g_out.prompt_logprobs[1:], r_out.prompt_token_ids[1:]):
            diffs.append(abs(a[tok].logprob - b[tok].logprob))
        r, g = r_out.outputs[0].token_ids, g_out.outputs[0].token_ids
        agree += next((i for i, (x, y) in enumerate(zip(r, g)) if x != y), len(r))
        total += len(r)
    return sum(diffs) / len(diffs), max(diffs), agree / total


def test_int8_model_stays_close_to_float32(greedy_runs: dict[str | None, list]) -> None:
    """Bounds from bf16 weights on the same model: int8 blocks move a weight by at most half a
    step, 1/254 of its block's largest |w| (~2.5 sigma for these random weights: an rms error
    of ~0.6% sigma), bf16 by 2^-9 relative (~0.1% sigma rms), and the activations are rounded
    too: int8 may be about ten times further from float32 than bf16 is, no more."""
    mean8, max8, agree8 = _distance(greedy_runs[None], greedy_runs["int8"])
    mean16, max16, _ = _distance(greedy_runs[None], greedy_runs["bf16"])
    assert mean8 > 0  # the int8 run really is quantized
    assert mean8 <= 10 * mean16 and max8 <= 10 * max16, (mean8, mean16, max8, max16)
    assert agree8 >= 0.5


def test_load_model_quantizes_every_linear_layer(tiny_model_dir: str) -> None:
    from tidal.worker.hf_config import load_hf_config
    from tidal.worker.loader import load_model

    model = load_model(tiny_model_dir, load_hf_config(tiny_model_dir), torch.float32, quantization="int8")
    slots = [m for m in model.modules() if hasattr(m, "packed_weight")]
    assert slots and all(isinstance(m.packed_weight, Int8Weight) for m in slots)
    with pytest.raises(ValueError, match="awq"):
        load_model(tiny_model_dir, load_hf_config(tiny_model_dir), torch.float32, quantization="awq")
