"""Speculative decoding (issue 33: n-gram and a draft model): speculation on never changes a token.

Every engine-level test compares against the same engine with speculation off (an
independent reference: one token a step, no proposals), on prompts that repeat themselves so
that proposals are made and accepted (asserted through the spec_decode_* counters). Each runs
with the n-gram proposer and with a draft model (the target with its weights perturbed: about
two thirds of its proposals are accepted, so both the accepted and the rejected paths run):

- greedy and seeded temperature-0.8 outputs, logprobs, penalties, min_tokens with EOS, EOS
  inside an accepted run, max_tokens and max_model_len exact, preemption under a tiny KV pool,
  every block free at the end (EngineCore in-process, one engine per config for the module);
- n=2, stop strings and DELTA streaming through LLM / LLMEngine (in-process);
The scheduler alone, the n-gram proposer and the engine arg: test_spec_scheduler.py.
"""
from __future__ import annotations

import random
from typing import Any, Iterator

import numpy as np
import pytest

from engine_utils import EOS, assert_all_blocks_free, greedy, make_core, model_path, req, run_to_completion
from tidal.core.engine_core import EngineCore
from tidal.frontend import LLM
from tidal.protocol import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tidal.protocol.messages import FinishReason
from tidal.protocol.speculative import SpeculativeConfig

SPEC = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4})
CORE_KW: dict[str, Any] = dict(max_model_len=256, num_kv_blocks=160, block_size=16, max_num_batched_tokens=64)


def repeating_prompts(seed: int, n: int, vocab: int = 512) -> list[list[int]]:
    """Prompts that repeat a random phrase (so the n-gram finds it), of different lengths."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        phrase = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 10))]
        out.append((phrase * 5)[: len(phrase) * 3 + i] + phrase[:3])
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny Qwen3 with large weights (init_std 1.0): peaked distributions, so that at
    temperature 0.8 too its outputs repeat themselves and proposals get accepted (the default
    tiny models sample nearly uniformly there). The tokenizer is the "tiny" model's."""
    from tidal.frontend.entrypoints.make_model import make_model

    out = tmp_path_factory.mktemp("spec-model")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", str(out / "cache"))
        return make_model(str(out / "model"), "qwen3", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, init_std=1.0, seed=3, tokenizer_dir=model_path("tiny"))


@pytest.fixture(scope="module")
def core_off(model: str) -> Iterator[EngineCore]:
    core = make_core(model, **CORE_KW)
    yield core
    core.shutdown()


@pytest.fixture(scope="module")
def draft_model(model: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The target with noise on its matrices (3% of each one's std): a draft that agrees with
    it often, not always."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    out = str(tmp_path_factory.mktemp("spec-draft") / "draft")
    shutil.copytree(model, out)
    weights = load_file(f"{out}/model.safetensors")
    gen = torch.Generator().manual_seed(1)
    weights = {k: (v + 0.03 * v.std() * torch.randn(v.shape, generator=gen)).to(v.dtype) if v.ndim == 2 else v
               for k, v in weights.items()}
    save_file(weights, f"{out}/model.safetensors", metadata={"format": "pt"})
    return out


def spec_config(kind: str, draft_model: str) -> SpeculativeConfig:
    if kind == "ngram":
        return SPEC
    return SpeculativeConfig.from_value({"model": draft_model, "num_speculative_tokens": 4})


@pytest.fixture(scope="module", params=["ngram", "draft"])
def core_on(request: pytest.FixtureRequest, model: str, draft_model: str) -> Iterator[EngineCore]:
    core = make_core(model, speculative_config=spec_config(request.param, draft_model), **CORE_KW)
    yield core
    core.shutdown()


def accepted(core: EngineCore) -> int:
    return core.scheduler.make_stats().spec_decode_num_accepted_tokens


def run_both(core_off: EngineCore, core_on: EngineCore, requests: list) -> tuple[Any, Any, int]:
    """(run without, run with speculation, proposals accepted in the latter); every block is
    free after each."""
    off = run_to_completion(core_off, requests)
    assert_all_blocks_free(core_off)
    before = accepted(core_on)
    on = run_to_completion(core_on, requests)
    assert_all_blocks_free(core_on)
    return off, on, accepted(core_on) - before


def assert_same(off: Any, on: Any) -> None:
    assert set(off.results) == set(on.results)
    for rid, r in off.results.items():
        o = on[rid]
        assert o.tokens == r.tokens, rid
        assert (o.finish_reason, o.stop_reason) == (r.finish_reason, r.stop_reason), rid


# ------------------------------------------------------------------ engine: token identity


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_outputs_identical_and_proposals_accepted(core_off: EngineCore, core_on: EngineCore, kind: str) -> None:
    prompts = repeating_prompts(1, 6)

    def params(i: int) -> SamplingParams:
        if kind == "greedy":
            return greedy(48)
        extra = dict(top_p=0.9, top_k=50) if i % 2 else {}
        return SamplingParams(temperature=0.8, seed=100 + i, max_tokens=48, ignore_eos=True, **extra)

    requests = [req(f"{kind}{i}", p, params(i)) for i, p in enumerate(prompts)]
    off, on, n_accepted = run_both(core_off, core_on, requests)
    assert_same(off, on)
    assert all(len(r.tokens) == 48 for r in on.results.values())
    assert n_accepted > 0
    # several tokens a step: fewer outputs (one per request per step that emitted tokens)
    assert sum(len(r.outputs) for r in on.results.values()) < sum(len(r.outputs) for r in off.results.values())
    stats = core_on.scheduler.make_stats()
    assert stats.spec_decode_num_drafts > 0
    assert stats.spec_decode_num_draft_tokens >= stats.spec_decode_num_accepted_tokens
    assert len(stats.spec_decode_num_accepted_tokens_per_pos) == SPEC.num_speculative_tokens
    assert sum(stats.spec_decode_num_accepted_tokens_per_pos) == stats.spec_decode_num_accepted_tokens
    # The blocks cached meanwhile hold the right KV: a prompt that continues the outputs hits
    # them (its whole prompt but the last block) and goes on as the reference does.
    follow = [req(f"{kind}-next{i}", prompts[i] + on[f"{kind}{i}"].tokens, greedy(16)) for i in range(len(prompts))]
    hits = core_on.scheduler.make_stats().prefix_cache_hits
    off2, on2, _ = run_both(core_off, core_on, follow)
    assert_same(off2, on2)
    assert core_on.scheduler.make_stats().prefix_cache_hits - hits >= sum(
        (len(r.prompt_token_ids) - 1) // CORE_KW["block_size"] * CORE_KW["block_size"] - 16 for r in follow)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_those_of_the_emitted_tokens(core_off: EngineCore, core_on: EngineCore,
                                                  temperature: float) -> None:
    prompts = repeating_prompts(2, 4)
    requests = [req(f"lp{temperature}-{i}", p, SamplingParams(temperature=temperature, seed=7 + i, max_tokens=32,
                                                              ignore_eos=True, logprobs=3))
                for i, p in enumerate(prompts)]
    off, on, n_accepted = run_both(core_off, core_on, requests)
    assert_same(off, on)
    assert n_accepted > 0
    for rid, r in off.results.items():
        a, b = r.logprobs, on[rid].logprobs
        assert a is not None and b is not None and len(b.ranks) == len(on[rid].tokens)
        assert b.token_ids[:, 0].tolist() == on[rid].tokens
        np.testing.assert_array_equal(a.token_ids, b.token_ids)
        np.testing.assert_array_equal(a.ranks, b.ranks)
        np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-4)  # float32 noise of the forward


def test_penalties_min_tokens_and_eos(core_off: EngineCore, core_on: EngineCore) -> None:
    """Penalties read the history each row would have; min_tokens holds EOS back per position;
    EOS (not ignored) ends the request where decoding would."""
    prompts = repeating_prompts(3, 6)
    kinds = [dict(temperature=0.0, repetition_penalty=1.2), dict(temperature=0.8, presence_penalty=0.3, seed=3),
             dict(temperature=0.8, frequency_penalty=0.2, seed=4), dict(temperature=0.0, min_tokens=20),
             dict(temperature=0.8, min_tokens=12, seed=5), dict(temperature=0.0)]
    requests = [req(f"pen{i}", p, SamplingParams(max_tokens=40, **kinds[i])) for i, p in enumerate(prompts)]
    # multi-token bad words (what the front-end makes of bad_words): the ban reads each row's history
    requests[-1].sampling_params._bad_words_token_ids = [[prompts[-1][1], prompts[-1][2]], [prompts[-1][0]]]
    off, on, n_accepted = run_both(core_off, core_on, requests)
    assert_same(off, on)
    assert n_accepted > 0
    for i in (3, 4):  # min_tokens: no EOS before
        assert EOS not in on[f"pen{i}"].tokens[: kinds[i]["min_tokens"]]


def test_structured_output_request_in_the_batch(core_off: EngineCore, core_on: EngineCore) -> None:
    """Constrained requests behind requests that speculate (n-gram: they speculate too, each
    proposal row masked; draft model: one token a step): each bitmask lands on its request's
    own rows among the step's sampling rows (tests/test_spec_structured.py has the rest)."""
    prompts = repeating_prompts(6, 4)
    constrained = [
        req("so", prompts[0], SamplingParams(temperature=0.8, seed=9, max_tokens=30,
                                             structured_outputs=StructuredOutputsParams(regex="(ab|cd){2,12}"))),
        req("so2", prompts[1], greedy(30, structured_outputs=StructuredOutputsParams(choice=["abab", "cdcd"]))),
    ]
    run_both(core_off, core_on, constrained)  # compiles the grammars: next time they are ready at once
    free = [req(f"free{i}", p, SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True))
            for i, p in enumerate(prompts)]
    off, on, n_accepted = run_both(core_off, core_on, free + constrained)  # admitted after the free ones
    assert_same(off, on)
    assert n_accepted > 0
    assert on["so"].finish_reason == FinishReason.STOP and on["so2"].finish_reason == FinishReason.STOP


def _null_token(rid: str, index: int, vocab: int = 512) -> int:
    """The token the null runner (core/executor.py) samples at sequence index `index`."""
    return 3 + (index * 7919 + len(rid)) % (vocab - 3)


def test_single_stream_verify_steps_replay_the_cpu_graph(core_off: EngineCore, core_on: EngineCore) -> None:
    """One request at a time: each verify step (1 + k rows) replays the CPU graph captured for
    1 + k rows, every row a decode of its own, and the tokens stay those of speculation off."""
    graphs = core_on.executor.worker.model_runner.cpu_graphs
    assert graphs is not None and 1 + SPEC.num_speculative_tokens in graphs.graphs
    total_accepted = 0
    for i, prompt in enumerate(repeating_prompts(4, 3)):
        request = [req(f"single{i}", prompt, greedy(40) if i % 2 else
                       SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True))]
        replays = graphs.replays
        off, on, n_accepted = run_both(core_off, core_on, request)
        assert_same(off, on)
        total_accepted += n_accepted
        # every step after the prefill replays: plain decodes and verify steps alike
        assert graphs.replays - replays == len(on[f"single{i}"].outputs) - 1
    assert total_accepted > 0


def test_eos_inside_an_accepted_run_ends_the_request_there(model: str) -> None:
    """The null runner's tokens are known in advance, so a prompt can hold the ones to come:
    the n-gram then proposes them, all are accepted, and an EOS among them ends the request
    at it, as decoding one token a step does (the tokens after it are dropped)."""
    rid, n = "eos", 40
    future = [_null_token(rid, n + i) for i in range(8)]
    prompt = [7] + future + [5] * (n - 2 - len(future)) + [7]  # "7 f(n)" -> f(n+1) .. f(n+4)
    eos = future[3]
    assert eos not in future[:3]
    runs = []
    for spec in (None, SPEC):
        core = make_core(model, model_runner="null", speculative_config=spec, **CORE_KW)
        try:
            run = run_to_completion(core, [req(rid, prompt, SamplingParams(temperature=0.0, max_tokens=20), eos=eos),
                                           req("all", prompt, greedy(20))])  # same length of id: same tokens
            assert_all_blocks_free(core)
        finally:
            core.shutdown()
        runs.append(run)
    off, on = runs
    assert on[rid].tokens == off[rid].tokens == future[:4]
    assert on[rid].finish_reason == off[rid].finish_reason == FinishReason.STOP
    assert [o.new_token_ids for o in on[rid].outputs] == [future[:1], future[1:4]]  # cut inside the run
    assert on["all"].tokens == off["all"].tokens and len(on["all"].outputs) < len(off["all"].outputs)


def test_max_tokens_and_max_model_len_exact(core_off: EngineCore, core_on: EngineCore) -> None:
    prompts = repeating_prompts(4, 8)
    requests = [req(f"len{i}", p, greedy(5 + 4 * i)) for i, p in enumerate(prompts)]
    # Up to max_model_len: the last proposals would run past it.
    long_prompt = (prompts[0] * 40)[: CORE_KW["max_model_len"] - 13]
    requests.append(req("ctx", long_prompt, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)))
    off, on, n_accepted = run_both(core_off, core_on, requests)
    assert_same(off, on)
    assert n_accepted > 0
    for i in range(8):
        assert len(on[f"len{i}"].tokens) == 5 + 4 * i and on[f"len{i}"].finish_reason == FinishReason.LENGTH
    assert len(on["ctx"].tokens) == 13 and on["ctx"].finish_reason == FinishReason.LENGTH


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_preemption_under_a_tiny_kv_pool(model: str, draft_model: str, core_off: EngineCore, kind: str) -> None:
    prompts = repeating_prompts(5, 8)
    requests = [req(f"pre{i}", p, greedy(40) if i % 2 else
                    SamplingParams(temperature=0.8, seed=i, max_tokens=40, ignore_eos=True))
                for i, p in enumerate(prompts)]
    off = run_to_completion(core_off, requests)
    tight = make_core(model, speculative_config=spec_config(kind, draft_model), **{**CORE_KW, "num_kv_blocks": 16})
    try:
        on = run_to_completion(tight, requests)
        assert_all_blocks_free(tight)
        stats = tight.scheduler.make_stats()
    finally:
        tight.shutdown()
    assert_same(off, on)
    assert on.stats.num_preemptions > 0
    assert stats.spec_decode_num_accepted_tokens > 0


# ------------------------------------------------------------------ draft model: coupling, EOS, refusal


def test_draft_equal_to_the_target_has_every_proposal_accepted(model: str, core_off: EngineCore) -> None:
    """The draft samples with the target's (seed, position) noise: a draft that *is* the
    target proposes exactly the tokens the target samples, greedy and at temperature 0.8 alike
    (an uncoupled draft would agree at 0.8 only by chance). Float noise between the draft's
    one-row passes and the target's batched rows may flip a rare near tie: >= 95%. An EOS the
    request does not ignore, taken from the reference output, lands inside an accepted run and
    ends the request there."""
    prompts = repeating_prompts(7, 4)
    # One prompt past the step budget (max_num_batched_tokens 64): the draft reads it in chunks
    # that fit the runner's buffers (draft_model.py's _catch_up), and must still agree.
    prompts.append((prompts[1] * 12)[:150])
    plain = [req(f"self{i}", p, SamplingParams(temperature=0.8 * (i % 2), seed=40 + i, max_tokens=40,
                                               ignore_eos=True)) for i, p in enumerate(prompts)]
    off = run_to_completion(core_off, plain)
    eos_at = 17
    eos = off["self0"].tokens[eos_at]
    first = off["self0"].tokens.index(eos)
    with_eos = [req("eos", prompts[0], SamplingParams(temperature=0.0, max_tokens=40), eos=eos)]
    off_eos = run_to_completion(core_off, with_eos)
    core = make_core(model, speculative_config=SpeculativeConfig.from_value(
        {"model": model, "num_speculative_tokens": 4}), **CORE_KW)
    try:
        on = run_to_completion(core, plain + with_eos)
        assert_all_blocks_free(core)
        stats = core.scheduler.make_stats()
        graphs = core.executor.worker.model_runner.cpu_graphs
        assert graphs is not None and graphs.graphs  # the draft's catch-up did not reallocate the buffers
    finally:
        core.shutdown()
    for rid, r in off.results.items():
        assert on[rid].tokens == r.tokens, rid
    assert on["eos"].tokens == off_eos["eos"].tokens == off["self0"].tokens[: first + 1]
    assert on["eos"].finish_reason == FinishReason.STOP
    assert stats.spec_decode_num_accepted_tokens >= 0.95 * stats.spec_decode_num_draft_tokens > 0, stats
    assert len(on["self0"].outputs) <= len(off["self0"].outputs) // 3  # ~5 tokens a step


def test_draft_with_another_tokenizer_is_refused(model: str, tmp_path: Any) -> None:
    import glob
    import shutil

    from tidal.frontend.entrypoints.make_model import make_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", str(tmp_path / "cache"))
        other = make_model(str(tmp_path / "other"), "qwen3", vocab_size=640, hidden_size=32, num_layers=1,
                           num_heads=2, num_kv_heads=1, seed=1)
    with pytest.raises(ValueError, match="has vocab_size 640, the target 512: a draft model must share"):
        make_core(model, speculative_config=SpeculativeConfig.from_value(
            {"model": other, "num_speculative_tokens": 2}), **CORE_KW)
    # The target's weights and config, another tokenizer: refused by the tokens themselves.
    swapped = str(tmp_path / "swapped")
    shutil.copytree(model, swapped)
    for f in glob.glob(f"{other}/*token*"):
        shutil.copy(f, swapped)
    with pytest.raises(ValueError, match="another tokenizer than the target .*must share the target's tokenizer"):
        make_core(model, speculative_config=SpeculativeConfig.from_value(
            {"model": swapped, "num_speculative_tokens": 2}), **CORE_KW)


# ------------------------------------------------------------------ LLM: n > 1, stop strings, DELTA


@pytest.fixture(scope="module", params=["ngram", "draft"])
def llms(request: pytest.FixtureRequest, model: str, draft_model: str) -> Iterator[tuple[LLM, LLM]]:
    kw = dict(multiprocessing=False, max_model_len=256, num_gpu_blocks_override=160, dtype="float32", device="cpu")
    off = LLM(model=model, **kw)
    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
            if request.param == "ngram" else {"model": draft_model, "num_speculative_tokens": 4})
    on = LLM(model=model, speculative_config=spec, **kw)
    yield off, on
    off.shutdown()
    on.shutdown()


TEXTS = ["one two three four, one two three four, one two three four, one two",
         "abc abc abc abc abc abc abc abc abc",
         "the cat sat on the mat and the cat sat on the mat and the cat sat",
         "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2"]


def _accepted(llm: LLM) -> int:
    return llm.get_stats().spec_decode_num_accepted_tokens


def _completions(outs: list) -> list[tuple]:
    return [(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason,
             None if o.logprobs is None else [sorted(row) for row in o.logprobs])
            for out in outs for o in out.outputs]


def test_llm_n2_seeded_with_logprobs(llms: tuple[LLM, LLM]) -> None:
    off, on = llms
    params = SamplingParams(n=2, temperature=0.8, seed=11, max_tokens=40, ignore_eos=True, logprobs=2)
    before = _accepted(on)
    a = off.generate(TEXTS, params, use_tqdm=False)
    b = on.generate(TEXTS, params, use_tqdm=False)
    assert _completions(a) == _completions(b)
    assert all(len(out.outputs) == 2 for out in b)
    for x, y in zip(a, b):  # summed in another order (several rows a step): float noise only
        for cx, cy in zip(x.outputs, y.outputs):
            assert cx.cumulative_logprob == pytest.approx(cy.cumulative_logprob, rel=1e-5, abs=1e-4)
    assert _accepted(on) > before


def test_llm_stop_strings(llms: tuple[LLM, LLM]) -> None:
    """A stop string ends the output where decoding ends it (text, tokens, reason); requests
    beside it still speculate."""
    off, on = llms
    free = off.generate(TEXTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), use_tqdm=False)
    stops = [out.outputs[0].text[12:15] for out in free]  # text every output does reach
    # Requests with stop strings speculate too: the front-end ends each output at the token
    # that completes its stop string, inside a step's run (tokens, text and logprobs).
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[s], logprobs=1) for s in stops]
    before = _accepted(on)
    a = off.generate(TEXTS, params, use_tqdm=False)
    b = on.generate(TEXTS, params, use_tqdm=False)
    assert _completions(a) == _completions(b)
    assert all(out.outputs[0].finish_reason == "stop" for out in b)
    assert _accepted(on) > before
    params = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[s]) for s in stops]
    params += [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * len(TEXTS)
    a = off.generate(TEXTS * 2, params, use_tqdm=False)
    b = on.generate(TEXTS * 2, params, use_tqdm=False)
    assert _completions(a) == _completions(b)


def _stream(llm: LLM, params: SamplingParams) -> tuple[dict[str, list[int]], dict[str, str], int]:
    """DELTA outputs through LLMEngine.step: (tokens, text per request, largest delta)."""
    engine = llm.llm_engine
    for i, text in enumerate(TEXTS):
        engine.add_request(f"d{i}", text, params)
    tokens: dict[str, list[int]] = {}
    texts: dict[str, str] = {}
    biggest = 0
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            delta = out.outputs[0]
            tokens.setdefault(out.request_id, []).extend(delta.token_ids)
            texts[out.request_id] = texts.get(out.request_id, "") + delta.text
            biggest = max(biggest, len(delta.token_ids))
    assert not engine.has_unfinished_requests()
    return tokens, texts, biggest


def test_llm_delta_streaming(llms: tuple[LLM, LLM]) -> None:
    off, on = llms
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=40, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    a_tokens, a_texts, _ = _stream(off, params)
    b_tokens, b_texts, biggest = _stream(on, params)
    assert a_tokens == b_tokens and a_texts == b_texts
    assert all(len(t) == 40 for t in b_tokens.values())
    assert biggest > 1  # some steps streamed several tokens at once
    stop = off.generate(TEXTS[0], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text[20:23]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[stop],
                            output_kind=RequestOutputKind.DELTA)
    assert _stream(off, params)[:2] == _stream(on, params)[:2]  # a stop string cut inside a streamed run


def test_core_sigkill_mid_stream_resumes_the_same_tokens(llms: tuple[LLM, LLM], model: str) -> None:
    """The core (its own process) is SIGKILLed once a request has 12 tokens; the restarted core
    gets each request back as prompt + tokens so far, speculates on, and every output is the
    one decoding without speculation gives."""
    import os
    import signal
    import threading
    import time

    off, on = llms
    params = [SamplingParams(temperature=0.8 * (i % 2), seed=60 + i, max_tokens=48, ignore_eos=True)
              for i in range(len(TEXTS))]
    reference = off.generate(TEXTS, params, use_tqdm=False)
    spec = on.config.speculative_config  # n-gram or the draft model, as `on` has
    llm = LLM(model=model, speculative_config=spec, max_model_len=256, num_gpu_blocks_override=160,
              dtype="float32", device="cpu", enable_prefix_caching=False)
    try:
        pid = llm.engine_core.process.pid

        def kill_when_generating() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                states = list(llm.output_processor.request_states.values())
                if any(len(st.generated) >= 12 for st in states):
                    break
                time.sleep(0.001)
            os.kill(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_when_generating, daemon=True)
        killer.start()
        resumed = llm.generate(TEXTS, params, use_tqdm=False)
        killer.join(60)
        assert llm.engine_core.supervisor.num_restarts == 1
        assert _completions(resumed) == _completions(reference)
        assert _accepted(llm) > 0  # the new core speculates too
    finally:
        llm.shutdown()
