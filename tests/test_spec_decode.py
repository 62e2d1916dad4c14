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
- the scheduler alone (no model): the rollback of rejected rows (num_computed_tokens, the blocks
  that held only them, the prefix cache), a stop inside the run, when no proposals are made;
- the engine arg: vLLM's keys and defaults, other methods refused by name;
- the n-gram proposer against a brute-force reading of vLLM's rule.
"""
from __future__ import annotations

import random
from typing import Any, Iterator

import numpy as np
import pytest

from engine_utils import EOS, assert_all_blocks_free, greedy, make_core, model_path, req, run_to_completion
from tidal.core.block_pool import update_block_hashes
from tidal.core.engine_core import EngineCore
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler import Scheduler
from tidal.core.spec_decode import ngram_propose
from tidal.frontend import LLM
from tidal.frontend.engine_args import EngineArgs
from tidal.protocol import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tidal.protocol.messages import FinishReason, LogprobsArrays, ModelRunnerOutput
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


# ------------------------------------------------------------------ scheduler alone (no model)


def _scheduler(k: int = 3, blocks: int = 32, budget: int = 64, **kw: Any) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=3,
                             disable_by_batch_size=kw.pop("disable_by_batch_size", None))
    return Scheduler(max_num_seqs=8, max_num_batched_tokens=budget, block_size=4, num_kv_blocks=blocks,
                     max_model_len=64, speculative_config=spec, **kw)


def _request(rid: str, prompt: list[int], **params: Any) -> Request:
    params.setdefault("max_tokens", 30)
    return Request(rid, prompt, SamplingParams(temperature=0.0, **params), eos_token_id=EOS)


def _step(s: Scheduler, sampled: dict[str, list[int]], logprobs: bool = False) -> tuple[Any, dict]:
    """Schedule a step and answer it as a runner would, with `sampled` (req_id -> tokens) for
    the requests whose rows reach their last token; returns (the schedule, outputs by id)."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    samples = {r: sampled.get(r, []) for r in ids
               if s.requests[r].num_computed_tokens + so.num_scheduled_tokens[r] >= s.requests[r].num_tokens}
    out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[samples.get(r, []) for r in ids])
    if logprobs:
        for r, tokens in samples.items():
            n = len(tokens)
            out.logprobs[r] = LogprobsArrays(np.array(tokens, dtype=np.int32)[:, None],
                                             np.zeros((n, 1), np.float32), np.ones(n, np.int32))
    outs = {o.request_id: o for group in s.update_from_output(so, out).values() for o in group}
    return so, outs


def _cached_hashes_ok(s: Scheduler, r: Request) -> None:
    """Every cached block of `r` holds its own tokens: positions below num_computed_tokens."""
    kv = s.kv_cache_manager
    expected: list[int] = []
    n = min(r.num_computed_tokens, r.num_tokens)
    update_block_hashes(expected, r.all_token_ids[:n], kv.block_size)
    for i, block in enumerate(kv.req_to_blocks[r.request_id]):
        if block.block_hash is not None:
            assert i < len(expected) and block.block_hash == expected[i], (i, block)


def _pool_adds_up(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    held = sum(len(kv.held_block_ids(rid)) for rid in s.requests)
    assert kv.num_free_blocks + held == kv.num_blocks


P = [10, 11, 12, 13, 14, 15, 10, 11, 12]  # after its first token (13), "11 12 13" proposes 14 15 10


def test_scheduler_rolls_back_rejected_rows() -> None:
    s = _scheduler()
    r = _request("a", P)
    s.add_request(r)
    so, _ = _step(s, {"a": [13]})  # the prefill
    assert so.scheduled_spec_decode_tokens == {} and r.num_computed_tokens == 9
    so, outs = _step(s, {"a": [14, 15, 99]})  # 14 and 15 accepted, 10 rejected: 99 in its place
    assert so.scheduled_spec_decode_tokens == {"a": [14, 15, 10]} and so.num_scheduled_tokens == {"a": 4}
    assert outs["a"].new_token_ids == [14, 15, 99]
    # Rows 9..11 had the right inputs (13, 14, 15); row 12 (input 10) is rolled back.
    assert r.num_computed_tokens == 12 and r.num_tokens == 13
    assert len(s.kv_cache_manager.req_to_blocks["a"]) == 4  # block 3 is where token 12 goes next
    assert r.num_dropped_blocks == 0
    _cached_hashes_ok(s, r)
    _pool_adds_up(s)
    stats = s.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
            stats.spec_decode_num_accepted_tokens_per_pos) == (1, 3, 2, [1, 1, 0])
    # One accepted: position 11 (input 15, rejected) would complete block 2 with the wrong KV;
    # it is not cached until recomputed.
    s = _scheduler()
    r = _request("b", P)
    s.add_request(r)
    _step(s, {"b": [13]})
    _step(s, {"b": [14, 99]})
    assert r.num_computed_tokens == 11 and r.num_tokens == 12
    # (block 3 held only row 12, rejected: dropped)
    assert [b.block_hash is not None for b in s.kv_cache_manager.req_to_blocks["b"]] == [True, True, False]
    _cached_hashes_ok(s, r)
    _step(s, {"b": [98]})  # position 11 recomputed (input 99): now block 2 is cached
    assert [b.block_hash is not None for b in s.kv_cache_manager.req_to_blocks["b"]][:3] == [True, True, True]
    _cached_hashes_ok(s, r)


def test_scheduler_drops_blocks_of_rejected_rows_and_tells_the_runner() -> None:
    s = _scheduler()
    r = _request("a", P)
    s.add_request(r)
    _step(s, {"a": [13]})
    free = s.kv_cache_manager.num_free_blocks
    so, outs = _step(s, {"a": [50]})  # rows 9..12, all rejected: row 12's block held nothing else
    assert so.scheduled_spec_decode_tokens == {"a": [14, 15, 10]} and so.scheduled_cached_reqs[0].new_block_ids
    assert outs["a"].new_token_ids == [50] and r.num_computed_tokens == 10 and r.num_tokens == 11
    assert len(s.kv_cache_manager.req_to_blocks["a"]) == 3 and s.kv_cache_manager.num_free_blocks == free
    assert r.num_dropped_blocks == 1
    _pool_adds_up(s)
    so, _ = _step(s, {"a": [51]})  # the runner is told to drop it from its table
    assert so.scheduled_cached_reqs[0].num_dropped_blocks == 1 and r.num_dropped_blocks == 0
    _cached_hashes_ok(s, r)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks


def test_scheduler_stop_inside_the_run() -> None:
    s = _scheduler()
    r = _request("a", P, stop_token_ids=[15], logprobs=0)
    s.add_request(r)
    _step(s, {"a": [13]}, logprobs=True)
    so, outs = _step(s, {"a": [14, 15, 10, 3]}, logprobs=True)  # all accepted, but 15 stops it
    assert so.scheduled_spec_decode_tokens == {"a": [14, 15, 10]}
    out = outs["a"]
    assert out.new_token_ids == [14, 15] and out.finish_reason == FinishReason.STOP and out.stop_reason == 15
    assert out.new_logprobs is not None and out.new_logprobs.token_ids[:, 0].tolist() == [14, 15]
    assert "a" not in s.requests and s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    # max_tokens: never more proposals than tokens still allowed (the bonus token is the last)
    s = _scheduler()
    s.add_request(_request("b", P, max_tokens=3))
    _step(s, {"b": [13]})
    so, outs = _step(s, {"b": [14, 15]})
    assert so.scheduled_spec_decode_tokens == {"b": [14]}
    assert outs["b"].new_token_ids == [14, 15] and outs["b"].finish_reason == FinishReason.LENGTH


class _Grammar:
    """Stands in for a structured-output request's grammar state: it forbids `forbidden`."""

    ready = True

    def __init__(self, forbidden: int = -1) -> None:
        self.forbidden = forbidden

    def accept_token(self, token: int) -> bool:
        return token != self.forbidden

    def is_terminated(self) -> bool:
        return False

    def num_valid_proposals(self, proposals: list[int]) -> int:
        return proposals.index(self.forbidden) if self.forbidden in proposals else len(proposals)


def test_scheduler_makes_no_proposals_when_it_cannot_or_should_not() -> None:
    # stop strings speculate (the front-end cuts the tokens after one); structured outputs
    # speculate, cut before the first proposal their grammar forbids; after a draft with
    # nothing accepted, one proposal (adaptive k)
    s = _scheduler()
    s.add_request(_request("stop", P, stop=["x"]))
    s.add_request(_request("plain", P))
    _step(s, {"stop": [13], "plain": [13]})
    so, _ = _step(s, {"stop": [14], "plain": [99]})
    assert so.scheduled_spec_decode_tokens == {"stop": [14, 15, 10], "plain": [14, 15, 10]}
    s.requests["plain"].structured_output_request = _Grammar(forbidden=15)  # type: ignore[assignment]
    s.requests["plain"].all_token_ids[-1] = s.requests["plain"].output_token_ids[-1] = 14  # a match again
    s.requests["plain"].spec_k = None
    so, _ = _step(s, {"stop": [15], "plain": [15]})
    assert so.scheduled_spec_decode_tokens == {"stop": [15]}  # plain: its first proposal, 15, is forbidden
    s.requests["plain"].structured_output_request = _Grammar(forbidden=12)  # type: ignore[assignment]
    so, _ = _step(s, {"stop": [10], "plain": [10]})
    assert so.scheduled_spec_decode_tokens["plain"] == [10, 11]  # "13 14 15" proposes 10 11 12: cut before 12
    # a draft model proposes in the worker, after the core built the masks: none for a grammar
    from tidal.core.spec_decode import SpecDecoder

    drafted = SpecDecoder(SpeculativeConfig.from_value({"method": "draft_model", "model": "unused",
                                                        "num_speculative_tokens": 3}), 256)
    r = s.requests["plain"]
    assert drafted.propose(r, 8) == []
    r.structured_output_request = None
    assert len(drafted.propose(r, 8)) > 0
    # disable_by_batch_size: none while that many requests run
    s = _scheduler(disable_by_batch_size=2)
    s.add_request(_request("x", P, max_tokens=2))
    s.add_request(_request("y", P))
    _step(s, {"x": [13], "y": [13]})
    so, _ = _step(s, {"x": [14], "y": [14]})  # x ends here (max_tokens=2)
    assert so.scheduled_spec_decode_tokens == {}
    so, _ = _step(s, {"y": [99]})
    assert so.scheduled_spec_decode_tokens == {"y": [15, 10, 11]}
    # the token budget caps them
    s = _scheduler(budget=2)
    s.add_request(_request("z", P))
    while s.requests["z"].num_output_tokens == 0:
        _step(s, {"z": [13]})
    so, _ = _step(s, {"z": [99]})
    assert so.scheduled_spec_decode_tokens == {"z": [14]} and so.num_scheduled_tokens == {"z": 2}
    # no n-gram match, none
    s = _scheduler()
    s.add_request(_request("w", [30, 31, 32, 33]))
    _step(s, {"w": [34]})
    so, _ = _step(s, {"w": [35]})
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"w": 1}


def test_proposal_count_adapts_and_a_request_that_never_hits_sits_out() -> None:
    """One more proposal than the last draft's accepted run (up to k); MISS_LIMIT drafts in a
    row with nothing accepted: the request sits out FIRST_BACKOFF steps, then twice as long
    after the next such run; an accepted proposal resets the sit-outs."""
    from tidal.core.spec_decode import FIRST_BACKOFF, MISS_LIMIT, SpecDecoder

    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2), 64)
    r = _request("a", [5, 6, 7] * 6)  # "... 6 7" is always followed by 5 6 7 5
    assert spec.propose(r, 16) == [5, 6, 7, 5]

    def sit_out() -> int:
        n = 0
        while not spec.propose(r, 16):
            n += 1
        return n

    for _ in range(MISS_LIMIT - 1):
        spec.record(len(spec.propose(r, 16)), 0, r)
    assert spec.propose(r, 16) == [5]  # one proposal after a draft of which nothing was accepted
    spec.record(1, 0, r)  # the third miss in a row
    assert sit_out() == FIRST_BACKOFF
    spec.record(1, 1, r)
    assert spec.propose(r, 16) == [5, 6]
    spec.record(2, 2, r)
    assert spec.propose(r, 16) == [5, 6, 7]
    spec.record(3, 1, r)
    assert spec.propose(r, 16) == [5, 6]
    for _ in range(MISS_LIMIT):
        spec.record(len(spec.propose(r, 16)), 0, r)
    assert sit_out() == FIRST_BACKOFF  # an accepted proposal since: the first sit-out's length
    for _ in range(MISS_LIMIT):
        spec.record(len(spec.propose(r, 16)), 0, r)
    assert sit_out() == 2 * FIRST_BACKOFF  # none accepted since: twice as long
    assert (spec.num_drafts, spec.num_accepted_tokens) == (3 * MISS_LIMIT + 3, 4)


def test_scheduler_drops_proposals_before_preempting() -> None:
    s = _scheduler(blocks=16)  # 64 tokens in all
    s.add_request(_request("big", list(range(100, 151))))  # 51 tokens: 13 blocks, no repeated n-gram
    s.add_request(_request("b", P))  # 3 blocks: the pool is full
    _step(s, {"big": [151], "b": [13]})
    assert s.kv_cache_manager.num_free_blocks == 0
    so, _ = _step(s, {"big": [152], "b": [14]})  # b's proposals would need a 4th block
    assert so.num_scheduled_tokens == {"big": 1, "b": 1} and so.scheduled_spec_decode_tokens == {}
    assert s.num_preemptions == 0


# ------------------------------------------------------------------ the n-gram proposer


def _brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """vLLM's rule read literally: the longest n in [lo, hi] whose suffix occurs earlier
    (ending before the last token), its earliest occurrence, the up to k tokens after it."""
    L = len(tokens)
    for n in range(hi, lo - 1, -1):
        for i in range(0, L - n):
            if tokens[i: i + n] == tokens[L - n:]:
                return tokens[i + n: i + n + k]
    return []


def test_ngram_matches_the_rule() -> None:
    assert ngram_propose(np.array([1, 2, 3, 4, 2, 3]), 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    assert ngram_propose(np.array([1, 1, 1, 1]), 2, 2, 3) == [1, 1]  # overlapping the suffix
    assert ngram_propose(np.array([5, 6, 7]), 1, 3, 2) == []
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 30))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 6)
        assert ngram_propose(np.array(tokens, dtype=np.int64), lo, hi, k) == _brute_force(tokens, lo, hi, k), \
            (tokens, lo, hi, k)


# ------------------------------------------------------------------ the engine arg


def test_speculative_config_keys_and_defaults() -> None:
    args = EngineArgs(model="/m", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    cfg = args.create_engine_config()
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 5, 5, None)  # vLLM's defaults: 5 and 5
    one = SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (one.method, one.prompt_lookup_min, one.prompt_lookup_max) == ("ngram", 4, 4)
    one = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                        "disable_by_batch_size": 8})
    assert (one.prompt_lookup_min, one.prompt_lookup_max, one.disable_by_batch_size) == (2, 2, 8)
    draft = SpeculativeConfig.from_value({"model": "/d", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/d", 3)  # vLLM's inference
    assert SpeculativeConfig.from_value({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2,
                                         "disable_by_batch_size": 4}).disable_by_batch_size == 4
    assert _roundtrip(EngineArgs(model="/m", speculative_config={"model": "/d", "num_speculative_tokens": 3})
                      .create_engine_config()).speculative_config == draft
    assert EngineArgs(model="/m").create_engine_config().speculative_config is None
    assert EngineArgs(model="/m", speculative_config={}).create_engine_config().speculative_config is None
    assert _roundtrip(cfg).speculative_config == cfg.speculative_config
    # the CLI's flag (tidal serve --speculative-config JSON), as vLLM's
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "/m", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'])
    assert EngineArgs.from_cli_args(ns).create_engine_config().speculative_config == SpeculativeConfig("ngram", 2, 3, 3)


def _roundtrip(cfg: Any) -> Any:
    from tidal.protocol import EngineConfig

    return EngineConfig.from_json(cfg.to_json())


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, ["'eagle'", "speculative decoding"]),
    ({"method": "eagle3", "num_speculative_tokens": 2}, ["'eagle3'"]),
    ({"method": "mtp", "num_speculative_tokens": 1}, ["'mtp'"]),
    ({"method": "draft_model", "num_speculative_tokens": 4}, ["'draft_model'", "needs model"]),
    ({"model": "/d", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, ["prompt_lookup_max", "n-gram"]),
    ({"model": "/d", "num_speculative_tokens": 4, "quantization": "fp8"}, ["quantization", "target's dtype"]),
    ({"method": "ngram"}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ["prompt_lookup_min"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ["disable_by_batch_size"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, ["draft"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, ["unknown", "lookahead"]),
])
def test_speculative_config_refused(value: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        EngineArgs(model="/m", speculative_config=value).create_engine_config()
    assert "speculative_config" in str(info.value)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
