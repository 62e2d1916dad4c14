"""Speculative decoding's verification rule (worker/spec_decode.py, worker/step_sampling.py)
against a straightforward reference: decode one token at a time, each row sampled alone with
the history emitted so far, stopping at the first token that differs from its proposal.

The batched path samples every row of every request at once (row j of a request at position
p + j with its proposals before j as history); on random logits both must emit the same tokens
and the same logprobs, for greedy and seeded random requests, with penalties, min_tokens,
multi-token bad words and logprobs, among requests without proposals."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tidal.protocol import SamplingParams
from tidal.protocol.messages import ModelRunnerOutput
from tidal.worker.logits_processors import NO_TOKEN
from tidal.worker.model_runner import CachedRequestState, _Batch
from tidal.worker.sampler import Sampler, SamplingMetadata
from tidal.worker.spec_decode import row_layout, verify
from tidal.worker.step_sampling import StepSampling

V = 3000  # past the sampler's 1024-token race blocks: its two-level race runs
EOS = 7


def _bad_words(params: SamplingParams, sequences: list[list[int]]) -> SamplingParams:
    params._bad_words_token_ids = sequences  # what the front-end makes of bad_words
    return params


PARAMS = {
    "greedy": lambda: SamplingParams(temperature=0.0, max_tokens=64),
    "greedy-logprobs": lambda: SamplingParams(temperature=0.0, max_tokens=64, logprobs=3),
    "seeded": lambda: SamplingParams(temperature=0.8, seed=1234, max_tokens=64),
    "seeded-truncated": lambda: SamplingParams(temperature=0.8, top_k=40, top_p=0.9, min_p=0.01, seed=99,
                                               max_tokens=64, logprobs=2),
    "penalties": lambda: SamplingParams(temperature=0.8, seed=5, presence_penalty=0.5, frequency_penalty=0.4,
                                        repetition_penalty=1.3, max_tokens=64),
    "greedy-penalties": lambda: SamplingParams(temperature=0.0, repetition_penalty=1.5, frequency_penalty=1.0,
                                               max_tokens=64),
    "min-tokens": lambda: SamplingParams(temperature=0.8, seed=8, min_tokens=6, stop_token_ids=[11, 12],
                                         max_tokens=64),
    "bad-words": lambda: _bad_words(SamplingParams(temperature=0.0, max_tokens=64), [[20, 21], [22]]),
}


class Harness(StepSampling):
    """The model runner's sampling half, without a model."""

    def __init__(self) -> None:
        self.requests: dict[str, CachedRequestState] = {}
        self.sampler = Sampler()
        self.vocab_size = V
        self.logprobs_mode = "raw_logprobs"


def reference_row(logits: torch.Tensor, st: CachedRequestState, history: list[int]) -> tuple[int, np.ndarray | None]:
    """The token decoding samples from `logits` [V] after `history` (tokens since st's), alone."""
    p = st.sampling_params
    tokens = st.token_ids + history
    md = SamplingMetadata.build([p], [tokens[: st.num_prompt_tokens]], [tokens[st.num_prompt_tokens:]],
                                [len(tokens)], [st.eos_token_id], V)
    out = Sampler()(logits[None].clone(), md)
    lp = None
    if out.logprobs is not None:
        lp = out.logprobs.logprobs[0].numpy()
    return int(out.sampled_token_ids[0]), lp


def reference_decode(logits: torch.Tensor, st: CachedRequestState, drafts: list[int]
                     ) -> tuple[list[int], list[np.ndarray]]:
    """One at a time: row j's token given the tokens emitted before it; stop at the first that
    differs from its proposal (or after the last row)."""
    emitted: list[int] = []
    lps: list[np.ndarray] = []
    for j in range(len(drafts) + 1):
        t, lp = reference_row(logits[j], st, emitted)
        emitted.append(t)
        if lp is not None:
            lps.append(lp)
        if j == len(drafts) or t != drafts[j]:
            break
    return emitted, lps


def make_drafts(rng: random.Random, logits: torch.Tensor, st: CachedRequestState, k: int, mode: str) -> list[int]:
    """k proposals: the reference's own tokens up to a random point (all of them with mode
    "all"), then a wrong one, then noise."""
    cut = k if mode == "all" else rng.randrange(0, k)
    drafts: list[int] = []
    for j in range(k):
        t, _ = reference_row(logits[j], st, drafts)
        if j < cut:
            drafts.append(t)
        elif j == cut:
            drafts.append((t + 1 + rng.randrange(V - 1)) % V)
        else:
            drafts.append(rng.randrange(V))
    return drafts


def test_verify_rule() -> None:
    rng = random.Random(0)
    for _ in range(500):
        k = rng.randrange(0, 6)
        target = [rng.randrange(4) for _ in range(k + 1)]
        draft = [rng.randrange(4) for _ in range(k)]
        want: list[int] = []
        for j in range(k + 1):  # the straightforward loop
            want.append(target[j])
            if j == k or target[j] != draft[j]:
                break
        assert verify(target, draft) == want
    assert verify([5], []) == [5]
    assert verify([1, 2, 3], [1, 2]) == [1, 2, 3]  # all accepted: the bonus token too
    assert verify([1, 9, 3], [1, 2]) == [1, 9]  # the mismatch replaced by the target's token


def test_row_layout() -> None:
    assert row_layout([0, 2, 3], {0: [5, 6], 3: [7]}) == ([0, 3, 4], [3, 1, 2])
    assert row_layout([1], {}) == ([0], [1])


@pytest.mark.parametrize("seed", range(6))
def test_batched_verification_matches_one_by_one(seed: int) -> None:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    h = Harness()
    names = list(PARAMS)
    rng.shuffle(names)
    # Four kinds of request: proposals all right (bonus), proposals wrong somewhere, no
    # proposals, and one that does not sample this step (a prefill chunk).
    req_ids, sample_rows, spec = [], [], {}
    blocks: list[torch.Tensor] = []
    for i, name in enumerate(names + ["chunk"]):
        rid = f"r{i}-{name}"
        req_ids.append(rid)
        if name == "chunk":
            continue
        prompt = [rng.randrange(3, V) for _ in range(rng.randrange(1, 20))]
        # Outputs that repeat tokens (penalties matter) and with a bad word's prefix at the end.
        out = [rng.choice(prompt + [20]) for _ in range(rng.randrange(0, 8))]
        p = PARAMS[name]()
        h.requests[rid] = CachedRequestState(rid, prompt + out, len(prompt), p, [], 0, EOS, i)
        k = [0, 1, 3, 5][i % 4]
        logits = torch.randn(k + 1, V, generator=g) * rng.choice([1.0, 3.0])
        # A few hot tokens win most rows, so a row's history decides among them (penalties,
        # min_tokens on EOS and the stop ids, the bad word 20 -> 21).
        hot = sorted({*prompt[:2], EOS, 11, 12, 20, 21})
        logits[:, hot] += 6.0 + torch.rand(k + 1, len(hot), generator=g)
        st = h.requests[rid]
        if k:
            spec[i] = make_drafts(rng, logits, st, k, "all" if i % 3 == 0 else "cut")
        sample_rows.append(i)
        blocks.append(logits)
    batch = _Batch(req_ids, None, None, None, sample_rows, None, [], spec=spec)  # type: ignore[arg-type]
    logits = torch.cat(blocks)
    assert batch.num_sample_logits == logits.shape[0]
    out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=[[] for _ in req_ids])
    h._sample_isolating(batch, logits, out)
    assert not out.failed_req_ids
    firsts, counts = row_layout(sample_rows, spec)
    accepted = bonus = 0
    for r, i in enumerate(sample_rows):
        st = h.requests[req_ids[i]]
        drafts = spec.get(i, [])
        want, want_lp = reference_decode(logits[firsts[r]: firsts[r] + counts[r]], st, drafts)
        assert out.sampled_token_ids[i] == want, (req_ids[i], drafts)
        accepted += len(want) - 1
        bonus += len(want) == len(drafts) + 1 and bool(drafts)
        got_lp = out.logprobs.get(st.req_id)
        if st.sampling_params.logprobs is None:
            assert got_lp is None
            continue
        assert got_lp is not None and len(got_lp.ranks) == len(want)
        assert got_lp.token_ids[:, 0].tolist() == want
        k = st.sampling_params.logprobs
        np.testing.assert_allclose(got_lp.logprobs, np.stack(want_lp)[:, : k + 1], rtol=0, atol=1e-5)
    assert out.sampled_token_ids[len(req_ids) - 1] == []  # the chunk samples nothing
    assert accepted > 0 and bonus > 0  # both outcomes were exercised


def test_rows_with_no_token_cut_the_run() -> None:
    batch = _Batch(["a", "b", "c"], None, None, None, [0, 1, 2], None, [],  # type: ignore[arg-type]
                   spec={0: [4, 5], 1: [4, 5]})
    layout = row_layout(batch.sample_rows, batch.spec)
    sampled = [4, NO_TOKEN, 9,  # a: accepted, then a row with nothing left: its tokens stop before it
               NO_TOKEN, 5, 6,  # b: its first row has nothing: it fails (no tokens)
               8]  # c: no proposals
    assert StepSampling._emitted(batch, sampled, layout) == [[4], [], [8]]
