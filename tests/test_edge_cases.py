"""Edge cases of issue 29: the context limit, rows whose every token is masked, and prompt
logprobs failing for one request.

1. The context limit, as vLLM's input processor: a prompt of max_model_len - 1 tokens runs and
   generates its one token (finish "length", transformers' greedy token); a prompt of
   max_model_len tokens leaves no room for one and is refused like a longer one, with an
   error naming the limit (vLLM V1's rule: "... plus the number of requested output tokens
   (at least 1) is longer than the maximum model length"; only V0 accepted it); the server's
   own bound agrees.
2. A row whose every token is masked (allowed_token_ids with bad_words, min_tokens or a
   structured-output grammar) fails its request alone as invalid, naming the settings, instead
   of sampling token 0; the other rows of its batch give what they give alone.
3. Prompt logprobs are isolated per request as sampling is: one request's failure there fails
   it alone; prompt_logprobs past the vocabulary is refused at admission.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from engine_utils import (
    EOS,
    VOCAB,
    RunResult,
    assert_all_blocks_free,
    assert_greedy_equal,
    check_logprobs,
    greedy,
    hf_generate,
    hf_log_softmax,
    make_core,
    model_path,
    random_prompt,
    req,
    robust_prompt,
    run_to_completion,
    run_with_culprits,
)
from fault_injection import use_prompt_logprobs_fault
from tidal.core.engine_core import EngineCore
from tidal.frontend import LLM
from tidal.frontend.entrypoints.openai.serving_context import ServingContext
from tidal.protocol import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tidal.protocol.messages import EngineCoreRequest, ErrorKind, FinishReason

M = "tiny"
L = 32  # max_model_len of the engines here
CULPRIT = 7  # the token id the prompt-logprob fault looks for among the tokens it scores
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    # Chunks of 8: a prompt at the limit is prefilled in several steps.
    with LLM(model=model_path(M), max_model_len=L, max_num_batched_tokens=8, dtype="float32",
             device="cpu") as engine:
        yield engine


@pytest.fixture(scope="module")
def core() -> Iterator[EngineCore]:
    engine = make_core(M, max_model_len=64, max_num_batched_tokens=24)
    yield engine
    engine.shutdown()


def _without(rng: random.Random, n: int, token: int = CULPRIT) -> list[int]:
    return [t for t in random_prompt(rng, n) if t != token]


# ------------------------------------------------------------------ 1. the context limit


@pytest.mark.parametrize("max_tokens", [None, 1, 5])
def test_a_prompt_one_short_of_the_limit_generates_its_one_token(llm: LLM, max_tokens: int | None) -> None:
    prompt = robust_prompt(M, random.Random(1), L - 1, 1)
    (out,) = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                                       ignore_eos=True), use_tqdm=False)
    (c,) = out.outputs
    assert c.finish_reason == "length" and len(c.token_ids) == 1, c
    assert_greedy_equal(list(c.token_ids), hf_generate(M, prompt, 1), "prompt of max_model_len - 1")


@pytest.mark.parametrize("n", [L, L + 1])
def test_a_prompt_that_leaves_no_room_is_refused_naming_the_limit(llm: LLM, n: int) -> None:
    """vLLM refuses both (its input processor: prompt_len == max_model_len leaves no room for
    the one token every generate request asks for), before anything is queued."""
    prompt = random_prompt(random.Random(2), n)
    with pytest.raises(ValueError, match=f"prompt length {n} .*max_model_len {L}"):
        llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match=f"max_model_len {L}"):  # a valid prompt beside it: nothing runs
        llm.generate([{"prompt_token_ids": prompt[: L - 1]}, {"prompt_token_ids": prompt}],
                     SamplingParams(max_tokens=1), use_tqdm=False)
    (ok,) = llm.generate({"prompt_token_ids": prompt[: L - 1]}, SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 1 and ok.outputs[0].finish_reason == "length"


def test_the_core_applies_the_same_bound(core: EngineCore) -> None:
    """A request that skipped a front-end's checks: refused by the core as invalid."""
    limit = core.info.max_model_len
    run = run_to_completion(core, [req(f"n{n}", random_prompt(random.Random(n), n), greedy(2))
                                   for n in (limit - 1, limit, limit + 1)])
    assert run[f"n{limit - 1}"].finish_reason == FinishReason.LENGTH and len(run[f"n{limit - 1}"].tokens) == 1
    for n in (limit, limit + 1):
        out = run[f"n{n}"].outputs[-1]
        assert out.finish_reason == FinishReason.ERROR and out.error_kind == ErrorKind.INVALID
        assert f"max_model_len {limit}" in (out.error or ""), out.error
    assert_all_blocks_free(core)


def test_the_servers_bound() -> None:
    """The OpenAI routes' max_tokens resolution (vLLM's rule and words): a prompt of
    max_model_len - 1 leaves one token (None: the engine fills it in); one more is a 400."""
    from tidal.frontend.entrypoints.openai.errors import APIError

    ctx: Any = SimpleNamespace(max_model_len=L)
    assert ServingContext.resolve_max_tokens(ctx, L - 1, None) is None
    assert ServingContext.resolve_max_tokens(ctx, L - 1, 1) == 1
    with pytest.raises(APIError, match=rf"too large: 2\. This model's maximum context length is {L} tokens"):
        ServingContext.resolve_max_tokens(ctx, L - 1, 2)
    for n in (L, L + 1):
        with pytest.raises(APIError, match=f"maximum context length is {L} tokens. However, your request has {n}"):
            ServingContext.resolve_max_tokens(ctx, n, None)


# ------------------------------------------------------------------ 2. every token masked


def _good_requests(tag: str = "good") -> list[EngineCoreRequest]:
    """Greedy and seeded random rows, with logprobs, penalties and token rules of their own
    (which share the masked rows' code paths)."""
    rng = random.Random(5)
    params = [
        greedy(MAX_TOKENS),
        greedy(MAX_TOKENS, logprobs=3, allowed_token_ids=[11, 12, 13, 14]),
        SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, min_tokens=2),
        SamplingParams(temperature=1.0, top_k=20, seed=12, frequency_penalty=0.5, max_tokens=MAX_TOKENS,
                       ignore_eos=True, logprobs=2, allowed_token_ids=list(range(20, 60))),
        greedy(MAX_TOKENS).clone(_bad_words_token_ids=[[40], [41, 42]]),
    ]
    return [req(f"{tag}-{i}", _without(rng, 5 + 3 * i), p) for i, p in enumerate(params)]


def _masked_requests() -> dict[str, tuple[EngineCoreRequest, list[str], int]]:
    """id -> (request, words its error must hold, tokens it makes before its row is all masked)."""
    rng = random.Random(9)
    grammar = StructuredOutputsParams(choice=["yes", "no"])
    cases: dict[str, tuple[SamplingParams, list[str], int]] = {
        # The only allowed token is a one-token bad word: masked from the first token on.
        "bad-word": (greedy(MAX_TOKENS, allowed_token_ids=[5]).clone(_bad_words_token_ids=[[5]]),
                     ["allowed_token_ids", "bad_words"], 0),
        # The only allowed token is the EOS, which min_tokens masks (a random row).
        "min-tokens": (SamplingParams(temperature=0.8, seed=3, max_tokens=MAX_TOKENS, allowed_token_ids=[EOS],
                                      min_tokens=3), ["allowed_token_ids", "min_tokens"], 0),
        # Masked only once its output ends with [5] (a two-token bad word), with logprobs.
        "later": (greedy(MAX_TOKENS, allowed_token_ids=[5], logprobs=2).clone(_bad_words_token_ids=[[5, 5]]),
                  ["allowed_token_ids", "bad_words"], 1),
        # A grammar that allows none of the allowed tokens.
        "grammar": (SamplingParams(temperature=1.0, seed=4, max_tokens=MAX_TOKENS, allowed_token_ids=[EOS],
                                   structured_outputs=grammar),
                    ["structured output grammar", "another setting", "may have masked every token"], 0),
    }
    return {rid: (req(rid, _without(rng, 6), p), words, n) for rid, (p, words, n) in cases.items()}


# Logprob values of a request may move by float rounding when it shares its steps with other
# requests: the extra rows change how its prompt is cut into prefill chunks, and torch's SDPA is
# not bitwise invariant to the query split on every CPU (seen at ~1e-6 with AVX-512). Its tokens,
# logprob token ids and ranks must not move at all.
LOGPROB_ATOL = 1e-5


def _assert_same(run: RunResult, reference: RunResult) -> None:
    """The reference's requests came out of `run` as they did alone (logprob values up to
    rounding, LOGPROB_ATOL)."""
    for rid, ref in reference.results.items():
        got = run[rid]
        assert got.finish_reason == ref.finish_reason and got.tokens == ref.tokens, rid
        for name in ("logprobs", "prompt_logprobs"):
            want, have = getattr(ref, name), getattr(got, name)
            assert (want is None) == (have is None), (rid, name)
            if want is not None:
                assert (have.token_ids == want.token_ids).all() and (have.ranks == want.ranks).all(), (rid, name)
                assert np.abs(have.logprobs - want.logprobs).max(initial=0.0) <= LOGPROB_ATOL, (rid, name)


def test_a_row_with_every_token_masked_fails_alone(core: EngineCore) -> None:
    reference = run_to_completion(core, _good_requests())
    masked = _masked_requests()
    requests = _good_requests()
    for i, (r, _, _) in enumerate(masked.values()):  # among the good rows, not first or last
        requests.insert(1 + i, r)
    run = run_to_completion(core, requests)
    for rid, (r, words, n) in masked.items():
        got = run[rid]
        out = got.outputs[-1]
        assert got.finish_reason == FinishReason.ERROR and out.error_kind == ErrorKind.INVALID, (rid, got)
        # No token is made up for the masked row (token 0 before); the tokens before it stand.
        assert len(got.tokens) == n and 0 not in got.tokens, (rid, got.tokens)
        assert all(t in r.sampling_params.allowed_token_ids for t in got.tokens), (rid, got.tokens)
        assert "every token is masked" in (got.error or ""), got.error
        for word in words:
            assert word in (got.error or ""), (rid, word, got.error)
    _assert_same(run, reference)
    assert_all_blocks_free(core)
    _assert_same(run_to_completion(core, _good_requests()), reference)  # and the engine serves on


def test_a_masked_row_is_a_value_error_through_llm(llm: LLM) -> None:
    params = SamplingParams(max_tokens=4, allowed_token_ids=[EOS], min_tokens=2)
    with pytest.raises(InvalidRequestError, match="every token is masked.*min_tokens"):
        llm.generate({"prompt_token_ids": [10, 11, 12]}, params, use_tqdm=False)
    (ok,) = llm.generate({"prompt_token_ids": [10, 11, 12]}, SamplingParams(max_tokens=2, ignore_eos=True),
                         use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 2


# ------------------------------------------------------------------ 3. prompt logprobs


def _prompt_logprob_requests(tag: str) -> list[EngineCoreRequest]:
    """Prompt-logprob requests of every shape (a chunked prompt, 1- and 2-token prompts, k=0,
    with sample logprobs) beside rows without prompt logprobs."""
    rng = random.Random(13)
    shapes: list[tuple[int, SamplingParams]] = [
        (40, greedy(MAX_TOKENS, prompt_logprobs=3, logprobs=2)),  # prefilled in two chunks
        (1, greedy(MAX_TOKENS, prompt_logprobs=3)),  # scores no prompt token
        (2, greedy(MAX_TOKENS, prompt_logprobs=0)),
        (9, SamplingParams(temperature=0.8, seed=21, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=5)),
        (7, greedy(MAX_TOKENS)),
        (8, SamplingParams(temperature=1.0, seed=22, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)),
    ]
    return [req(f"{tag}-{i}", _without(rng, n), p) for i, (n, p) in enumerate(shapes)]


def _prompt_logprob_culprits(n: int) -> list[EngineCoreRequest]:
    """Requests whose prompt logprobs fail under the fault: CULPRIT sits inside the prompt
    (the second one's in its second chunk, after its first chunk's rows were sent)."""
    rng = random.Random(17)
    prompts = [_without(rng, 4) + [CULPRIT] + _without(rng, 4), _without(rng, 30) + [CULPRIT] + _without(rng, 3)]
    return [req(f"bad-{i}", prompts[i], SamplingParams(temperature=0.8, seed=30 + i, max_tokens=MAX_TOKENS,
                                                       ignore_eos=True, prompt_logprobs=2)) for i in range(n)]


@pytest.fixture(scope="module")
def prompt_logprobs_reference(core: EngineCore) -> RunResult:
    return run_to_completion(core, _prompt_logprob_requests("good"))


@pytest.mark.parametrize("num_culprits", [1, 2])
def test_a_prompt_logprobs_failure_fails_that_request_alone(
        monkeypatch: pytest.MonkeyPatch, core: EngineCore, prompt_logprobs_reference: RunResult,
        num_culprits: int) -> None:
    use_prompt_logprobs_fault(monkeypatch, CULPRIT)
    run = run_with_culprits(core, _prompt_logprob_requests("good"), _prompt_logprob_culprits(num_culprits),
                            "prompt logprobs failed", "injected prompt logprobs failure")
    _assert_same(run, prompt_logprobs_reference)
    assert_all_blocks_free(core)


def test_prompt_logprobs_of_every_shape_match_transformers(prompt_logprobs_reference: RunResult) -> None:
    """The reference run itself: chunked, 1-token and 2-token prompts score every prompt token
    after the first, as transformers' log-softmax does (a 1-token prompt: no row)."""
    for r in _prompt_logprob_requests("good"):
        got = prompt_logprobs_reference[r.request_id]
        k = r.sampling_params.prompt_logprobs
        plp = got.prompt_logprobs
        if k is None or len(r.prompt_token_ids) == 1:
            assert plp is None or len(plp.ranks) == 0, r.request_id
            continue
        ref = hf_log_softmax(M, r.prompt_token_ids)
        check_logprobs(plp, ref[:-1], r.prompt_token_ids[1:], k, what=f"{r.request_id} prompt_logprobs")


def test_a_one_token_prompt_has_prompt_logprobs_none(llm: LLM) -> None:
    (out,) = llm.generate({"prompt_token_ids": [10]}, SamplingParams(max_tokens=2, prompt_logprobs=3), use_tqdm=False)
    assert out.prompt_logprobs == [None]


def test_every_prompt_logprob_request_failing_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """As with sampling: when each prompt-logprob request of a step fails on its own, no single
    request explains it, and the step raises (the core process reports the engine dead)."""
    use_prompt_logprobs_fault(monkeypatch, CULPRIT)
    engine = make_core(M, max_model_len=64)
    try:
        for r in _prompt_logprob_culprits(1):
            engine.add_request(r)
            engine.add_request(req("bad-twin", list(r.prompt_token_ids), r.sampling_params))
        with pytest.raises(IndexError, match="injected prompt logprobs failure"):
            for _ in range(10):
                engine.step()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("field", ["prompt_logprobs", "logprobs"])
def test_logprobs_past_the_vocabulary_are_refused_at_admission(field: str) -> None:
    """With max_logprobs above the vocabulary, a request for more logprobs than there are
    tokens is refused naming the vocabulary size (it used to be cut to the vocabulary
    silently); the whole vocabulary (-1, or its size) is fine."""
    engine = make_core(M, max_model_len=64, max_logprobs=1000)
    try:
        run = run_to_completion(engine, [req(f"k{k}", [10, 11, 12], greedy(2, **{field: k}))
                                         for k in (VOCAB + 1, VOCAB, -1)])
    finally:
        engine.shutdown()
    out = run[f"k{VOCAB + 1}"].outputs[-1]
    assert out.finish_reason == FinishReason.ERROR and out.error_kind == ErrorKind.INVALID
    assert f"{field}={VOCAB + 1}" in (out.error or "") and f"vocabulary size {VOCAB}" in (out.error or ""), out.error
    for k in (VOCAB, -1):
        got = run[f"k{k}"]
        assert got.finish_reason == FinishReason.LENGTH, (k, got.error)
        arrays = got.prompt_logprobs if field == "prompt_logprobs" else got.logprobs
        assert arrays is not None and arrays.token_ids.shape[1] == VOCAB + 1, k


def test_logprobs_past_the_vocabulary_are_a_value_error_in_the_front_end() -> None:
    from tidal.frontend.input_processor import InputProcessor

    processor = InputProcessor(None, max_model_len=64, vocab_size=VOCAB, max_logprobs=1000)
    with pytest.raises(ValueError, match=f"vocabulary size {VOCAB}"):
        processor.process("r", {"prompt_token_ids": [10, 11]}, SamplingParams(prompt_logprobs=VOCAB + 1))
    processor.process("r", {"prompt_token_ids": [10, 11]}, SamplingParams(prompt_logprobs=VOCAB))


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
@pytest.mark.parametrize("sync_free", [False, True])
def test_the_sampler_marks_rows_with_no_token_left(mode: str, sync_free: bool) -> None:
    """Sampler level: a row whose masks leave nothing samples NO_TOKEN (not token 0, not a
    NaN draw); every other row samples (and reports) what it does alone."""
    import torch

    from tidal.worker.sampler import NO_TOKEN, Sampler, SamplingMetadata

    V = 3000
    rows: list[tuple[SamplingParams, list[int]]] = [  # (params, output so far)
        (SamplingParams(temperature=0.0, logprobs=2), []),
        (SamplingParams(temperature=0.0, allowed_token_ids=[5], logprobs=1).clone(_bad_words_token_ids=[[5]]), []),
        (SamplingParams(temperature=0.9, seed=1, top_p=0.9, allowed_token_ids=[5, 9]), [4]),
        (SamplingParams(temperature=0.7, seed=2, top_p=0.8, min_p=0.05, allowed_token_ids=[EOS], min_tokens=2), [4]),
        (SamplingParams(temperature=1.0, seed=3, top_k=5, allowed_token_ids=[5], logprobs=3)
         .clone(_bad_words_token_ids=[[4, 5]]), [4]),
        (SamplingParams(temperature=0.8, seed=4, min_tokens=3, logprobs=0), [4]),
        # Checked (its masks might have left nothing) but one token is left: 9.
        (SamplingParams(temperature=0.9, seed=5, allowed_token_ids=[5, 9], logprobs=1)
         .clone(_bad_words_token_ids=[[5]]), []),
    ]
    dead = {1, 3, 4}

    def metadata(subset: list[int]) -> SamplingMetadata:
        return SamplingMetadata.build([rows[i][0] for i in subset], [[1, 2]] * len(subset),
                                      [rows[i][1] for i in subset], [3 + len(rows[i][1]) for i in subset],
                                      [EOS] * len(subset), V, "cpu", logprobs_mode=mode)

    logits = torch.randn(len(rows), V, generator=torch.Generator().manual_seed(0)) * 3
    out = Sampler(sync_free=sync_free)(logits, metadata(list(range(len(rows)))))
    tokens = out.sampled_token_ids.tolist()
    assert [i for i, t in enumerate(tokens) if t == NO_TOKEN] == sorted(dead), tokens
    assert tokens[6] == 9
    for i in sorted(set(range(len(rows))) - dead):
        alone = Sampler(sync_free=sync_free)(logits[i: i + 1], metadata([i]))
        assert tokens[i] == alone.sampled_token_ids.item(), i
        if rows[i][0].logprobs is not None:
            k = rows[i][0].logprobs + 1
            assert out.logprobs is not None and alone.logprobs is not None
            assert torch.equal(out.logprobs.token_ids[i, :k], alone.logprobs.token_ids[0, :k]), i
            assert torch.equal(out.logprobs.logprobs[i, :k], alone.logprobs.logprobs[0, :k]), i
