"""Sampler against a plain one-row-at-a-time numpy reference of the vLLM definitions."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from tidal.protocol import SamplingParams
from tidal.protocol.messages import LogprobsArrays
from tidal.worker import logprobs as logprobs_mod
from tidal.worker.sampler import (
    LogprobsTensors,
    Sampler,
    SamplingMetadata,
    argmax,
    _mix64,
    _topk,
    compute_prompt_logprobs,
)

V = 3000  # not a multiple of 64 or 1024: short last blocks get exercised
EOS = 7


# ---------------------------------------------------------------- reference


def ref_probs(logits: np.ndarray, p: SamplingParams, prompt: list[int], output: list[int], eos: int | None) -> np.ndarray:
    """The distribution one row samples from (greedy rows: softmax at temperature 1)."""
    x = logits.astype(np.float64).copy()
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | ({eos} if eos is not None else set()):
            x[t] = -np.inf
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (c > 0)
    if p.temperature >= 1e-5:
        x = x / p.temperature

    def softmax(v: np.ndarray) -> np.ndarray:
        e = np.exp(v - v.max())
        return e / e.sum()

    probs = softmax(x)
    if p.temperature < 1e-5:
        return probs
    if p.min_p > 0:
        probs[probs < p.min_p * probs.max()] = 0.0
        probs /= probs.sum()
    if p.top_k > 0:
        kth = np.sort(probs)[::-1][min(p.top_k, len(probs)) - 1]
        probs[probs < kth] = 0.0
        probs /= probs.sum()
    if p.top_p < 1.0:
        desc = np.sort(probs)[::-1]
        excl = np.cumsum(desc) - desc
        n = int(np.sum(excl < p.top_p))
        probs[probs < desc[n - 1]] = 0.0
        probs /= probs.sum()
    return probs


def u64_splitmix(z: int) -> int:
    m = (1 << 64) - 1
    z &= m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


# ---------------------------------------------------------------- helpers


def make_logits(b: int, v: int = V, scale: float = 2.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, v, generator=g) * scale


def build(params: list[SamplingParams], prompts: list[list[int]] | None = None,
          outputs: list[list[int]] | None = None, positions: list[int] | None = None,
          v: int = V) -> SamplingMetadata:
    b = len(params)
    prompts = prompts or [[1, 2, 3, 2] for _ in range(b)]
    outputs = outputs or [[] for _ in range(b)]
    if positions is None:
        positions = [len(pr) + len(o) for pr, o in zip(prompts, outputs)]
    return SamplingMetadata.build(params, prompts, outputs, positions, [EOS] * b, v, "cpu")


def check_against_reference(sampler: Sampler, logits: torch.Tensor, params: list[SamplingParams],
                            prompts: list[list[int]], outputs: list[list[int]]) -> None:
    md = build(params, prompts, outputs)
    got = sampler.apply_processors(logits, md).numpy()
    for r, p in enumerate(params):
        want = ref_probs(logits[r].numpy(), p, prompts[r], outputs[r], EOS)
        np.testing.assert_allclose(got[r], want, rtol=1e-4, atol=1e-7, err_msg=f"row {r}: {p}")
        assert set(np.nonzero(got[r])[0]) == set(np.nonzero(want)[0]), f"support differs, row {r}"


# ---------------------------------------------------------------- processors


def test_penalties_each_and_combined() -> None:
    prompts = [[5, 9, 9, 100, 2999]] * 6
    outputs = [[9, 9, 9, 42, 100, 0], [0, 1, 1], [], [42, 42, 7], [3, 3, 3, 3], [9]]
    params = [
        SamplingParams(repetition_penalty=1.5),
        SamplingParams(frequency_penalty=0.7),
        SamplingParams(presence_penalty=1.2),
        SamplingParams(repetition_penalty=0.8, frequency_penalty=-0.5, presence_penalty=0.4),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0),  # greedy
        SamplingParams(),  # no penalty, in a batch that has them
    ]
    logits = make_logits(6)
    logits[:, [0, 9, 42, 100]] = torch.tensor([3.0, -2.0, 4.0, 0.0])  # both signs for repetition
    sampler = Sampler()
    check_against_reference(sampler, logits, params, prompts, outputs)
    # The count table is reused between steps and must come back clean.
    check_against_reference(sampler, logits, params, prompts, [o[::-1] + [5] for o in outputs[1:]] + [[]])
    assert not sampler._bufs["count"].any()


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    params = [SamplingParams(min_tokens=3, stop_token_ids=[11, 12]), SamplingParams(min_tokens=2, stop_token_ids=[11]),
              SamplingParams(min_tokens=3, ignore_eos=True, temperature=0.0)]
    outputs = [[4], [4, 5], []]
    md = build(params, outputs=outputs)
    assert md.min_tokens == {0: {EOS, 11, 12}, 2: {EOS}}  # eos blocked even with ignore_eos, like vLLM
    logits = make_logits(3)
    logits[:, EOS] = 50.0  # would win every draw if not masked
    probs = Sampler().apply_processors(logits, md)
    assert probs[0, [EOS, 11, 12]].sum() == 0 and probs[2, EOS] == 0 and probs[1, EOS] > 0.99
    check_against_reference(Sampler(), logits, params, [[1, 2, 3, 2]] * 3, outputs)
    out = Sampler()(logits, md).sampled_token_ids
    assert out[0] != EOS and out[1] == EOS and out[2] != EOS


TRUNCATION = [
    SamplingParams(top_k=1), SamplingParams(top_k=5, temperature=0.7), SamplingParams(top_k=50, temperature=1.5),
    SamplingParams(top_k=5000),  # larger than the vocab
    SamplingParams(top_p=0.1), SamplingParams(top_p=0.5, temperature=0.6), SamplingParams(top_p=0.9),
    SamplingParams(top_p=0.99, temperature=2.0),  # nucleus of thousands: widening path
    SamplingParams(min_p=0.05), SamplingParams(min_p=0.3, temperature=1.3),
    SamplingParams(top_k=40, top_p=0.8), SamplingParams(min_p=0.02, top_p=0.7),
    SamplingParams(min_p=0.1, top_k=10, top_p=0.95, temperature=0.8),
    SamplingParams(temperature=0.9), SamplingParams(temperature=0.0),
]


@pytest.mark.parametrize("candidates, sync_free", [(64, False), (3, False), (64, True)])
def test_truncation_matches_reference(candidates: int, sync_free: bool) -> None:
    """sync_free: the GPU's way (a full sort for top-p, masks for min-p: nothing read back)."""
    b = len(TRUNCATION)
    logits = make_logits(b, seed=1)
    sampler = Sampler(top_p_candidates=candidates, sync_free=sync_free)
    check_against_reference(sampler, logits, TRUNCATION, [[1]] * b, [[]] * b)


def test_sync_free_sampling_draws_the_same_tokens() -> None:
    """The GPU's sync-free truncation and the CPU's candidate search draw the same tokens."""
    b = len(TRUNCATION)
    logits = make_logits(b, seed=2)
    md = build(TRUNCATION, [[1]] * b, [[]] * b)
    a = Sampler(sync_free=False)(logits, md).sampled_token_ids
    assert torch.equal(Sampler(sync_free=True)(logits, md).sampled_token_ids, a)


def test_truncation_with_penalties_and_peaky_logits() -> None:
    params = [p.clone(repetition_penalty=1.3, frequency_penalty=0.3) for p in TRUNCATION]
    b = len(params)
    logits = make_logits(b, scale=6.0, seed=2)
    check_against_reference(Sampler(), logits, params, [[1, 5, 5]] * b, [[7, 8, 8, 40]] * b)


def test_top_k_keeps_ties() -> None:
    logits = torch.full((1, V), -5.0)
    logits[0, [3, 10, 20]] = 2.0
    logits[0, 30] = 4.0
    probs = Sampler().apply_processors(logits, build([SamplingParams(top_k=2)]))
    assert set(torch.nonzero(probs[0]).flatten().tolist()) == {3, 10, 20, 30}


# ---------------------------------------------------------------- sampling


def test_greedy_is_argmax() -> None:
    logits = make_logits(8, seed=3)
    logits[2, [17, 900]] = 30.0  # tie: the first index wins, like torch.argmax
    md = build([SamplingParams(temperature=0.0)] * 8)
    assert md.all_greedy
    assert torch.equal(Sampler()(logits, md).sampled_token_ids, logits.argmax(-1))
    # Mixed batch with penalties: greedy rows take the argmax of the penalised logits.
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0) if i % 2 else SamplingParams(seed=i)
              for i in range(8)]
    outputs = [[int(logits[i].argmax())] for i in range(8)]
    md = build(params, outputs=outputs)
    got = Sampler()(logits, md).sampled_token_ids
    for i in range(1, 8, 2):
        want = ref_probs(logits[i].numpy(), params[i], [1, 2, 3, 2], outputs[i], EOS).argmax()
        assert got[i] == want != outputs[i][0]


@pytest.mark.parametrize("block_size", [1024, 16])
@pytest.mark.parametrize("knobs", [dict(top_k=12), dict(top_p=0.8), dict(min_p=0.1, temperature=1.3), dict()])
def test_sampling_frequencies_match_distribution(block_size: int, knobs: dict) -> None:
    v, n = 300, 20000
    row = make_logits(1, v, scale=1.5, seed=4)
    params = SamplingParams(seed=1234, **knobs)
    want = ref_probs(row[0].numpy(), params, [1], [], None)
    # One call: the same row at n positions; draws at different positions are independent.
    md = build([params] * n, prompts=[[1]] * n, positions=list(range(n)), v=v)
    tokens = Sampler(block_size=block_size)(row.expand(n, v), md).sampled_token_ids.numpy()
    counts = np.bincount(tokens, minlength=v)
    assert counts[want == 0].sum() == 0, "sampled outside the support"
    expected = want * n
    big = expected >= 5
    pooled_obs = counts[big].tolist() + [counts[~big].sum()]
    pooled_exp = expected[big].tolist() + [expected[~big].sum()]
    obs, exp = np.array(pooled_obs), np.array(pooled_exp)
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, (chi2, dof)


def random_params(rng: np.random.Generator, i: int) -> SamplingParams:
    kind = i % 5
    if kind == 0:
        return SamplingParams(temperature=0.0)
    return SamplingParams(
        seed=int(rng.integers(0, 2**40)),
        temperature=float(rng.uniform(0.3, 1.5)),
        top_k=int(rng.choice([0, 5, 50])) if kind in (1, 4) else 0,
        top_p=float(rng.choice([1.0, 0.9, 0.5])) if kind in (2, 4) else 1.0,
        min_p=0.05 if kind == 3 else 0.0,
        repetition_penalty=1.2 if kind == 4 else 1.0,
        frequency_penalty=0.4 if kind == 3 else 0.0,
        logprobs=2 if kind == 2 else None,
    )


@pytest.mark.parametrize("target", [SamplingParams(seed=77, temperature=1.2),
                                    SamplingParams(seed=-5, top_p=0.95, top_k=100, repetition_penalty=1.1),
                                    SamplingParams(seed=2**63 + 12345, min_p=0.01, logprobs=3)])
def test_draw_depends_only_on_seed_and_position(target: SamplingParams) -> None:
    rng = np.random.default_rng(0)
    row = make_logits(1, scale=0.5, seed=5)  # flat: a draw is far from fixed
    prompt, output, pos = [4, 5, 6], [8, 9], 5
    sampler = Sampler()

    def draw_in(batch_index: int, size: int, seed: int, s: Sampler = sampler) -> int:
        params = [random_params(rng, i) for i in range(size)]
        logits = make_logits(size, scale=2.0, seed=seed)
        prompts = [[1, 2]] * size
        outputs = [[3]] * size
        params[batch_index], prompts[batch_index], outputs[batch_index] = target, prompt, output
        logits[batch_index] = row[0]
        positions = [int(rng.integers(0, 1000)) for _ in range(size)]
        positions[batch_index] = pos
        md = SamplingMetadata.build(params, prompts, outputs, positions, [EOS] * size, V, "cpu")
        return int(s(logits, md).sampled_token_ids[batch_index])

    alone = draw_in(0, 1, 0)
    assert draw_in(0, 64, 1) == alone
    assert draw_in(37, 64, 2) == alone
    assert draw_in(63, 64, 3) == alone
    assert draw_in(0, 1, 0) == alone  # scratch buffer reuse
    assert draw_in(5, 9, 4, Sampler(top_p_candidates=2)) == alone  # top-p width does not matter

    # Other positions / seeds give other draws.
    def row_draws(seeds: list[int], positions: list[int]) -> list[int]:
        params = [target.clone(seed=s) for s in seeds]
        md = SamplingMetadata.build(params, [prompt] * len(seeds), [output] * len(seeds), positions,
                                    [EOS] * len(seeds), V, "cpu")
        return sampler(row.expand(len(seeds), V), md).sampled_token_ids.tolist()

    assert len(set(row_draws([target.seed] * 20, list(range(20))))) > 10  # type: ignore[list-item]
    assert len(set(row_draws(list(range(20)), [pos] * 20))) > 10


def test_mix64_is_splitmix64() -> None:
    vals = [0, 1, 12345, 2**63 - 1, -1, -(2**63), 0x9E3779B97F4A7C15 - 2**64]
    got = _mix64(torch.tensor(vals, dtype=torch.int64)).tolist()
    for v, g in zip(vals, got):
        assert g & ((1 << 64) - 1) == u64_splitmix(v)


def test_block_helpers_match_torch() -> None:
    x = make_logits(5, v=3000, seed=6)
    x[1, [70, 2990, 5]] = 100.0  # ties on the max across blocks
    x[2] = 0.0  # everything tied
    assert torch.equal(argmax(x), x.argmax(-1))
    for k in (1, 7, 11):
        vals, idx = _topk(x, k)
        assert torch.equal(vals, x.topk(k, -1).values)
        assert torch.equal(x.gather(1, idx), vals)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_with_ranks() -> None:
    params = [SamplingParams(temperature=0.5, repetition_penalty=1.5, top_k=3, logprobs=4, seed=1),
              SamplingParams(temperature=0.0, logprobs=0), SamplingParams(logprobs=2, seed=2),
              SamplingParams(seed=3)]
    logits = make_logits(4, seed=7)
    logits[1, [10, 20, 30]] = 25.0  # greedy row: tied max, picks 10, rank 1
    out = Sampler()(logits, build(params, outputs=[[1, 2], [], [3], []]))
    lpt = out.logprobs
    assert isinstance(lpt, LogprobsTensors) and lpt.token_ids.shape == (4, 5) and lpt.token_ids.dtype == torch.int32
    ref = torch.log_softmax(logits, -1)
    tok = out.sampled_token_ids
    assert tok[1] == 10
    assert torch.equal(lpt.token_ids[:, 0].long(), tok)
    torch.testing.assert_close(lpt.logprobs[:, 0], ref.gather(1, tok[:, None]).squeeze(1))
    torch.testing.assert_close(lpt.logprobs[:, 1:], ref.topk(4, -1).values)
    torch.testing.assert_close(ref.gather(1, lpt.token_ids[:, 1:].long()), lpt.logprobs[:, 1:])
    want_ranks = (ref > ref.gather(1, tok[:, None])).sum(-1) + 1
    assert torch.equal(lpt.ranks.long(), want_ranks) and lpt.ranks[1] == 1
    # Per-row k: the runner keeps the first k+1 columns.
    arr = lpt.slice([2], num_logprobs=2).to_arrays()
    assert isinstance(arr, LogprobsArrays) and arr.token_ids.shape == (1, 3)
    assert arr.token_ids.dtype == np.int32 and arr.logprobs.dtype == np.float32 and arr.ranks.dtype == np.int32
    assert lpt.slice(1).token_ids.shape == (1, 5)
    assert Sampler()(logits, build([SamplingParams(seed=1)] * 4)).logprobs is None


def test_logprobs_from_half_precision_logits() -> None:
    logits = make_logits(3, seed=8).to(torch.bfloat16)
    out = Sampler()(logits, build([SamplingParams(seed=i, logprobs=1) for i in range(3)]))
    ref = torch.log_softmax(logits.float(), -1)
    assert out.logprobs is not None
    torch.testing.assert_close(out.logprobs.logprobs[:, 1], ref.max(-1).values)


def test_prompt_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    n = 13
    logits = make_logits(n, seed=9)
    targets = torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(0))
    logits[4, [1, 2, 3]] = 40.0  # target ties with two others at the top: rank 1
    targets[4] = 2
    logits[5, [50, 60]] = 40.0
    logits[5, 70] = 39.0  # target is third best: rank 3 (two strictly greater)
    targets[5] = 70
    ref = torch.log_softmax(logits, -1)
    for chunk in (1 << 25, V * 4):  # second: 4 rows per chunk
        monkeypatch.setattr(logprobs_mod, "PROMPT_CHUNK_ELEMS", chunk)
        lp = compute_prompt_logprobs(logits, targets, 3)
        assert lp.token_ids.shape == (n, 4)
        assert torch.equal(lp.token_ids[:, 0].long(), targets)
        torch.testing.assert_close(lp.logprobs[:, 0], ref.gather(1, targets[:, None]).squeeze(1))
        torch.testing.assert_close(lp.logprobs[:, 1:], ref.topk(3, -1).values)
        assert torch.equal(lp.ranks.long(), (ref > ref.gather(1, targets[:, None])).sum(-1) + 1)
        assert lp.ranks[4] == 1 and lp.ranks[5] == 3
    assert compute_prompt_logprobs(logits, targets, 0).token_ids.shape == (n, 1)


# ---------------------------------------------------------------- metadata


def test_build_skips_unused_knobs() -> None:
    md = build([SamplingParams(seed=1), SamplingParams(temperature=0.0, top_k=5, top_p=0.5)])
    assert md.top_k is None and md.top_p is None and md.min_p is None  # greedy rows count as off
    assert md.no_penalties and md.prompt_token_ids is None and md.max_num_logprobs is None
    assert not md.all_greedy and not md.all_random and md.temperature.tolist() == [1.0, 0.0]
    md = build([SamplingParams(top_k=3, repetition_penalty=1.2, logprobs=2), SamplingParams(logprobs=5)],
               prompts=[[1, 2, 3], [4]])
    assert md.top_k is not None and md.top_k.tolist() == [3, 0] and md.all_random
    assert md.prompt_token_ids is not None and md.prompt_token_ids.tolist() == [[1, 2, 3], [4, V, V]]
    assert md.presence_penalties is None and md.repetition_penalties is not None
    assert md.max_num_logprobs == 5 and not md.no_penalties


def test_temperatures_past_float32_sample_uniformly_from_what_is_allowed() -> None:
    """1e308 is a valid temperature: 1 / T underflowed float32 and masked (-inf) logits became
    NaN, so a token outside allowed_token_ids (or a structured-output grammar) was drawn. Any T
    that hot is uniform over the allowed tokens; processed logprobs stay finite there too."""
    allowed = [5, 9, 11]
    logits = make_logits(1, seed=4)
    for t in (1e30, 1e100, 1e308):
        drawn = Counter()
        for seed in range(60):
            md = build([SamplingParams(temperature=t, allowed_token_ids=allowed, seed=seed)])
            drawn[int(Sampler()(logits.clone(), md).sampled_token_ids[0])] += 1
        assert set(drawn) == set(allowed), (t, drawn)
        md = SamplingMetadata.build([SamplingParams(temperature=t, allowed_token_ids=allowed, seed=0, logprobs=2)],
                                    [[1, 2]], [[]], [2], [EOS], V, "cpu", logprobs_mode="processed_logprobs")
        lp = Sampler()(logits.clone(), md).logprobs
        assert lp is not None and torch.isfinite(lp.logprobs).all()
        torch.testing.assert_close(lp.logprobs[0], torch.full((3,), -np.log(3.0)))  # uniform over 3
