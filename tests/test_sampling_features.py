"""vLLM's token-level SamplingParams (bad_words, allowed_token_ids, logit_bias, logprobs=-1)
and logprobs_mode: the engine core against a reference built from transformers logits, and
the sampler against one built from the logits it is given."""
from __future__ import annotations

import random
from typing import Callable

import numpy as np
import pytest
import torch

from engine_utils import (
    VOCAB,
    assert_all_blocks_free,
    assert_greedy_equal,
    greedy,
    hf_generate,
    hf_model,
    make_core,
    req,
    robust_prompt,
    run_to_completion,
)
from tidal.protocol import SamplingParams
from tidal.protocol.messages import FinishReason
from tidal.worker.logits_processors import bad_words_banned_now
from tidal.worker.sampler import Sampler, SamplingMetadata

M = "tiny"
Mask = Callable[[list[int], torch.Tensor], torch.Tensor]  # (output so far, logits [V]) -> logits


def hf_masked_greedy(prompt: list[int], max_tokens: int, mask: Mask) -> list[int]:
    """Greedy decoding by transformers where each step's logits first go through `mask`."""
    model, out = hf_model(M), []
    with torch.no_grad():
        for _ in range(max_tokens):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            out.append(int(mask(out, logits.clone()).argmax()))
    return out


def run_core(requests: list, **kwargs: object):  # type: ignore[no-untyped-def]
    core = make_core(M, max_model_len=128, **kwargs)
    try:
        run = run_to_completion(core, requests)
        assert_all_blocks_free(core)
        return run
    finally:
        core.shutdown()


def with_bad_words(params: SamplingParams, sequences: list[list[int]]) -> SamplingParams:
    params._bad_words_token_ids = sequences  # what the front-end makes of bad_words
    return params


# ------------------------------------------------------------------ bad words, allowed, bias


def test_bad_words_single_and_multi_token() -> None:
    rng = random.Random(1)
    prompt, plain = robust_prompt(M, rng, 12, 10), robust_prompt(M, rng, 9, 10)
    ref = hf_generate(M, prompt, 10).tokens
    single = [[ref[0]]]  # the token greedy emits first: never emitted now
    multi = [[ref[1], ref[2]]]  # after ref[1], ref[2] is banned

    def ban(sequences: list[list[int]]) -> Mask:
        def mask(out: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[list(bad_words_banned_now(sequences, out))] = float("-inf")
            return logits
        return mask

    run = run_core([req("single", prompt, with_bad_words(greedy(10), single)),
                    req("multi", prompt[1:], with_bad_words(greedy(10), multi)),
                    req("plain", plain, greedy(10))])
    assert ref[0] not in run["single"].tokens
    assert run["single"].tokens == hf_masked_greedy(prompt, 10, ban(single))
    got = run["multi"].tokens
    assert not any(got[i:i + 2] == multi[0] for i in range(len(got) - 1))
    assert got == hf_masked_greedy(prompt[1:], 10, ban(multi))
    assert_greedy_equal(run["plain"].tokens, hf_generate(M, plain, 10), "plain row in the same batch")


def test_bad_words_rule() -> None:
    assert bad_words_banned_now([[5], [1, 2, 3], [4, 6]], [9, 1, 2]) == {5, 3}
    assert bad_words_banned_now([[1, 2, 3]], [2]) == set()  # the output is shorter than the head
    assert bad_words_banned_now([[4, 6]], []) == set()


def test_allowed_token_ids_only() -> None:
    rng = random.Random(2)
    prompt = robust_prompt(M, rng, 10, 8)
    allowed = sorted(rng.sample(range(3, VOCAB), 12))

    def only(out: list[int], logits: torch.Tensor) -> torch.Tensor:
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return masked

    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True, allowed_token_ids=allowed)
    run = run_core([req("greedy", prompt, greedy(8, allowed_token_ids=allowed)), req("random", prompt, seeded)])
    assert run["greedy"].tokens == hf_masked_greedy(prompt, 8, only)
    assert set(run["random"].tokens) <= set(allowed) and len(run["random"].tokens) == 20


def test_logit_bias_moves_argmax() -> None:
    rng = random.Random(3)
    prompt = robust_prompt(M, rng, 10, 8)
    ref = hf_generate(M, prompt, 8).tokens
    target = next(t for t in range(3, VOCAB) if t not in ref)
    forced = {target: 100.0}  # larger than any logit gap: the argmax every step
    mixed = {ref[0]: -3.0, ref[1]: 2.5, target: 1.5}

    def biased(bias: dict[int, float]) -> Mask:
        def mask(out: list[int], logits: torch.Tensor) -> torch.Tensor:
            for t, b in bias.items():
                logits[t] += b
            return logits
        return mask

    run = run_core([req("forced", prompt, greedy(8, logit_bias=forced)),
                    req("mixed", prompt, greedy(8, logit_bias=mixed))])
    assert run["forced"].tokens == [target] * 8
    assert run["mixed"].tokens == hf_masked_greedy(prompt, 8, biased(mixed))
    assert run["mixed"].tokens != ref  # the bias changed something


def test_logit_bias_survives_the_wire() -> None:
    from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
    from tidal.protocol.messages import EngineCoreRequest

    params = with_bad_words(SamplingParams(logit_bias={"7": 250, 9: -1.5}, allowed_token_ids=[7, 9],
                                           flat_logprobs=True, truncate_prompt_tokens=3), [[1, 2], [3]])
    frames = MsgpackEncoder().encode(EngineCoreRequest("r", [1, 2], params))
    got = MsgpackDecoder(EngineCoreRequest).decode(frames).sampling_params
    assert got.logit_bias == {7: 100.0, 9: -1.5} and got == params
    assert got.bad_words_token_ids == [[1, 2], [3]]


# ------------------------------------------------------------------ logprobs=-1


def test_whole_vocabulary_logprobs() -> None:
    rng = random.Random(4)
    prompt = robust_prompt(M, rng, 8, 3)
    run = run_core([req("all", prompt, greedy(3, logprobs=-1, prompt_logprobs=-1))], max_logprobs=-1)
    for arrays, rows in ((run["all"].logprobs, 3), (run["all"].prompt_logprobs, len(prompt) - 1)):
        assert arrays.token_ids.shape == (rows, VOCAB + 1)
        assert (np.sort(arrays.token_ids[:, 1:], axis=1) == np.arange(VOCAB)).all()
        np.testing.assert_allclose(np.exp(arrays.logprobs[:, 1:].astype(np.float64)).sum(1), 1.0, atol=1e-5)
        assert (arrays.ranks >= 1).all()
    assert run["all"].tokens == hf_generate(M, prompt, 3).tokens


# ------------------------------------------------------------------ bad ids at the core


def test_out_of_range_ids_fail_alone_at_the_core() -> None:
    rng = random.Random(5)
    good = robust_prompt(M, rng, 10, 6)
    bad = {
        "allowed": greedy(4, allowed_token_ids=[5, VOCAB]),
        "allowed_empty": greedy(4, allowed_token_ids=[]),
        "bias": greedy(4, logit_bias={-3: 1.0}),
        "bad_words": with_bad_words(greedy(4), [[5, VOCAB + 7]]),
        "bad_words_empty": with_bad_words(greedy(4), [[5]]),
        "all_vocab": greedy(4, logprobs=-1),  # max_logprobs is 20
    }
    bad["bad_words_empty"]._bad_words_token_ids = [[]]  # past SamplingParams' own check, as from a wire
    run = run_core([req("good", good, greedy(6))] + [req(rid, [5, 6], p) for rid, p in bad.items()])
    assert {e.request_id for e in run.errors} == set(bad)
    messages = {e.request_id: e.error for e in run.errors}
    assert "allowed_token_ids contains out-of-vocab token id!" in messages["allowed"]
    assert "allowed_token_ids is not None and empty!" in messages["allowed_empty"]
    assert "[-3] in logit_bias contain out-of-vocab token ids. Vocabulary size: 512" in messages["bias"]
    assert f"specified as bad: [{VOCAB + 7}]" in messages["bad_words"]
    assert "empty sequence" in messages["bad_words_empty"]
    assert "Requested sample logprobs of 512, which is greater than max allowed: 20" in messages["all_vocab"]
    assert all(run[rid].finish_reason == FinishReason.ERROR for rid in bad)
    assert_greedy_equal(run["good"].tokens, hf_generate(M, good, 6), "good request beside bad ones")


# ------------------------------------------------------------------ logprobs_mode


def reference_values(logits: np.ndarray, p: SamplingParams, output: list[int], mode: str) -> np.ndarray:
    """vLLM's definition of what each logprobs_mode reports for one row (float64)."""
    x = logits.astype(np.float64)
    if mode.startswith("raw"):
        return x if mode == "raw_logits" else x - np.logaddexp.reduce(x)
    x = x.copy()
    for t, b in (p.logit_bias or {}).items():
        x[t] += b
    for t in set(output):  # presence / frequency penalties
        x[t] -= p.presence_penalty + p.frequency_penalty * output.count(t)
    if p.temperature >= 1e-5:
        x = x / p.temperature
        probs = np.exp(x - x.max())
        if p.top_k > 0:
            x[probs < np.sort(probs)[::-1][p.top_k - 1]] = -np.inf
        if p.min_p > 0:
            x[probs < p.min_p * probs.max()] = -np.inf
    return x if mode == "processed_logits" else x - np.logaddexp.reduce(x[np.isfinite(x)])


MODE_PARAMS = [
    SamplingParams(temperature=0.0, logprobs=4),
    SamplingParams(temperature=0.7, top_k=5, seed=1, logprobs=4, logit_bias={3: 2.0}),
    SamplingParams(temperature=1.3, min_p=0.2, seed=2, logprobs=2, presence_penalty=0.5, frequency_penalty=0.3),
    SamplingParams(temperature=0.0, logprobs=3, logit_bias={10: 5.0}),
]


@pytest.mark.parametrize("mode", ["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"])
def test_logprobs_modes_against_reference(mode: str) -> None:
    v = 200
    logits = torch.randn(len(MODE_PARAMS), v, generator=torch.Generator().manual_seed(0)) * 3
    outputs = [[], [], [4, 4, 9], []]
    md = SamplingMetadata.build(MODE_PARAMS, [[1, 2]] * 4, outputs, [5] * 4, [None] * 4, v, "cpu",
                                logprobs_mode=mode)
    out = Sampler()(logits, md)
    assert out.logprobs is not None
    for row, (p, o) in enumerate(zip(MODE_PARAMS, outputs)):
        ref = reference_values(logits[row].numpy(), p, o, mode)
        ids = out.logprobs.token_ids[row, : p.logprobs + 1].numpy()
        got = out.logprobs.logprobs[row, : p.logprobs + 1].numpy()
        chosen = int(out.sampled_token_ids[row])
        assert ids[0] == chosen and np.isfinite(ref[chosen])
        np.testing.assert_allclose(got, ref[ids], rtol=1e-5, atol=1e-4, err_msg=f"{mode} row {row}")
        np.testing.assert_allclose(got[1:], np.sort(ref)[::-1][: p.logprobs], rtol=1e-5, atol=1e-4)
        assert int(out.logprobs.ranks[row]) == 1 + int((ref > ref[chosen] + 1e-5).sum())


def test_logprobs_mode_through_the_engine() -> None:
    """processed_logprobs at the core: a greedy row with a logit bias reports the biased
    distribution (raw_logprobs would report the model's)."""
    rng = random.Random(6)
    prompt = robust_prompt(M, rng, 10, 4)
    bias = {7: 3.0, 11: -2.0}
    params = greedy(4, logprobs=3, logit_bias=bias)
    runs = {mode: run_core([req("r", prompt, params)], logprobs_mode=mode)["r"]
            for mode in ("raw_logprobs", "processed_logprobs")}
    tokens = runs["raw_logprobs"].tokens
    assert tokens == runs["processed_logprobs"].tokens
    with torch.no_grad():
        logits = hf_model(M)(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float()
    biased = logits.clone()
    for t, b in bias.items():
        biased[:, t] += b
    for mode, ref_logits in (("raw_logprobs", logits), ("processed_logprobs", biased)):
        lp = torch.log_softmax(ref_logits, -1)
        arrays = runs[mode].logprobs
        want = lp.gather(1, torch.tensor(tokens)[:, None]).squeeze(1).numpy()
        np.testing.assert_allclose(arrays.logprobs[:, 0], want, atol=1e-4, err_msg=mode)
        np.testing.assert_allclose(arrays.logprobs[:, 1:], lp.topk(3, -1).values.numpy(), atol=1e-4)


def test_unused_features_build_nothing() -> None:
    """Rows without these features pay nothing: no rules are built, greedy stays an argmax."""
    params = [SamplingParams(temperature=0.0), SamplingParams(seed=3, top_k=4)]
    md = SamplingMetadata.build(params, [[1]] * 2, [[]] * 2, [1, 1], [None] * 2, 50, "cpu")
    assert md.token_rules is None and md.plain
    with_bias = SamplingMetadata.build([SamplingParams(logit_bias={3: 1.0})], [[1]], [[]], [1], [None], 50, "cpu")
    assert with_bias.token_rules is not None and not with_bias.plain
