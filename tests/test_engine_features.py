"""EngineCore features end to end (real model, in-process), against transformers.

Issue "Scheduler and sampler complete": the exact chunked-prefill schedule, prefix caching,
preemption under a tiny pool, logprobs / prompt logprobs, a randomized invariant sweep, stop
conditions and bad requests.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_utils import (
    assert_all_blocks_free,
    assert_greedy_equal,
    check_logprobs,
    greedy,
    Ref,
    hf_generate,
    hf_log_softmax,
    hf_model,
    make_core,
    random_prompt,
    robust_prompt,
    req,
    run_to_completion,
)
from tidal.protocol import SamplingParams
from tidal.protocol.messages import EngineCoreEventType, FinishReason

M = "tiny"


# ------------------------------------------------------------------ chunked prefill


def test_exact_chunked_prefill_schedule() -> None:
    rng = random.Random(1)
    a, b = robust_prompt(M, rng, 12, 4), robust_prompt(M, rng, 12, 4)
    core = make_core(M, max_num_batched_tokens=10, max_model_len=64, num_kv_blocks=16)
    try:
        run = run_to_completion(core, [req("A", a, greedy(4)), req("B", b, greedy(4))])
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    assert [s.num_scheduled_tokens for s in run.steps] == [
        {"A": 10},
        {"A": 2, "B": 8},  # A samples its 1st token
        {"A": 1, "B": 4},  # B samples its 1st token
        {"A": 1, "B": 1},
        {"A": 1, "B": 1},  # A's 4th token: finished
        {"B": 1},
    ]
    # Outputs only when a token came out (none for a chunk that stops short of the prompt).
    assert [len(o.new_token_ids) for o in run["A"].outputs] == [1, 1, 1, 1]
    assert_greedy_equal(run["A"].tokens, hf_generate(M, a, 4), "A")
    assert_greedy_equal(run["B"].tokens, hf_generate(M, b, 4), "B")


# ------------------------------------------------------------------ prefix caching


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_caching_shared_prefix(caching: bool) -> None:
    bs = 16
    rng = random.Random(2)
    prefix = robust_prompt(M, rng, 3 * bs, 6)  # also prompt "D" as it is
    prompts = {
        "A": robust_prompt(M, rng, 7, 12, prefix),
        "B": robust_prompt(M, rng, 10, 8, prefix),  # joins while A decodes (A's blocks in use)
        "C": robust_prompt(M, rng, 1, 6, prefix),  # after A and B ended (blocks free, still cached)
        "D": list(prefix),  # exactly 3 blocks: the last token is always recomputed
    }
    core = make_core(M, block_size=bs, max_model_len=128, num_kv_blocks=32, enable_prefix_caching=caching)
    try:
        run1 = run_to_completion(core, [req("A", prompts["A"], greedy(12))],
                                 joins={3: [req("B", prompts["B"], greedy(8))]})
        assert_all_blocks_free(core)
        hits_ab = run1.stats.prefix_cache_hits
        run2 = run_to_completion(core, [req("C", prompts["C"], greedy(6))])
        hits_c = run2.stats.prefix_cache_hits - hits_ab
        run3 = run_to_completion(core, [req("D", prompts["D"], greedy(6))])
        hits_d = run3.stats.prefix_cache_hits - hits_ab - hits_c
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    results = {**run1.results, **run2.results, **run3.results}
    first_chunk = {rid: s.num_scheduled_tokens[rid] for r in (run1, run2, run3) for s in reversed(r.steps)
                   for rid in s.new_reqs}
    if caching:
        assert results["A"].num_cached_tokens == 0
        assert results["B"].num_cached_tokens == 3 * bs
        assert results["C"].num_cached_tokens == 3 * bs
        assert results["D"].num_cached_tokens == 2 * bs
        assert (hits_ab, hits_c, hits_d) == (3 * bs, 3 * bs, 2 * bs)
        assert first_chunk["B"] == 10 and first_chunk["C"] == 1 and first_chunk["D"] == bs
    else:
        assert all(r.num_cached_tokens == 0 for r in results.values())
        assert run3.stats.prefix_cache_hits == 0
        assert first_chunk["B"] == len(prompts["B"])
    # Cached KV is correct: same greedy tokens as transformers.
    for rid, n in (("A", 12), ("B", 8), ("C", 6), ("D", 6)):
        assert_greedy_equal(results[rid].tokens, hf_generate(M, prompts[rid], n), rid)


# ------------------------------------------------------------------ preemption


def test_preemption_tiny_pool_matches_large_pool_and_hf() -> None:
    rng = random.Random(4)
    prompts = {f"p{i}": robust_prompt(M, rng, n, 40) for i, n in enumerate([40, 38, 42, 41])}
    reqs = [req(rid, p, greedy(40)) for rid, p in prompts.items()]
    outs = {}
    for blocks in (8, 64):
        core = make_core(M, block_size=16, max_model_len=128, num_kv_blocks=blocks,
                         disable_log_stats=False)  # events are recorded with stats only
        try:
            outs[blocks] = run_to_completion(core, reqs)
            assert_all_blocks_free(core)
        finally:
            core.shutdown()
    tight, roomy = outs[8], outs[64]
    assert tight.stats.num_preemptions > 0
    assert roomy.stats.num_preemptions == 0
    assert all(s.stats.num_free_blocks >= 0 for s in tight.steps)
    preempted = {rid for rid, r in tight.results.items()
                 if any(e[0] == EngineCoreEventType.PREEMPTED for o in r.outputs for e in (o.events or []))}
    assert preempted
    for rid, prompt in prompts.items():
        assert tight[rid].finish_reason == FinishReason.LENGTH
        assert tight[rid].tokens == roomy[rid].tokens, rid
        assert_greedy_equal(tight[rid].tokens, hf_generate(M, prompt, 40), rid)


# ------------------------------------------------------------------ logprobs


def _check_request_logprobs(rid: str, prompt: list[int], r, k: int | None, pk: int | None) -> None:
    seq = prompt + r.tokens
    ref = hf_log_softmax(M, seq)
    if k is not None:
        lp = r.logprobs
        assert lp is not None and len(lp.ranks) == len(r.tokens), rid
        rows = ref[len(prompt) - 1: len(seq) - 1]
        check_logprobs(lp, rows, r.tokens, k, what=f"{rid} logprobs")
    else:
        assert r.logprobs is None
    if pk is not None:
        plp = r.prompt_logprobs
        # Complete: one row per prompt token after the first, across all outputs, no repeats.
        assert plp is not None and len(plp.ranks) == len(prompt) - 1, (rid, None if plp is None else len(plp.ranks))
        check_logprobs(plp, ref[: len(prompt) - 1], prompt[1:], pk, what=f"{rid} prompt_logprobs")
    else:
        assert r.prompt_logprobs is None


def test_logprobs_and_prompt_logprobs_chunked() -> None:
    rng = random.Random(5)
    specs = {  # rid: (prompt len, params)
        "g": (29, greedy(10, logprobs=5, prompt_logprobs=3)),
        "s": (17, SamplingParams(temperature=1.0, seed=9, max_tokens=10, ignore_eos=True, logprobs=5,
                                 prompt_logprobs=3)),
        "k0": (11, SamplingParams(temperature=1.3, top_k=7, seed=3, max_tokens=8, ignore_eos=True, logprobs=0,
                                  prompt_logprobs=0)),
        "p": (23, greedy(6, prompt_logprobs=3)),
        "l": (5, greedy(6, logprobs=2)),
        "one": (1, greedy(3, prompt_logprobs=3)),  # a 1-token prompt has no prompt logprob rows
        "two": (2, greedy(3, logprobs=1, prompt_logprobs=2)),
        "fin1": (37, greedy(1, logprobs=3, prompt_logprobs=4)),  # finishes in its last prefill chunk
    }
    prompts = {rid: random_prompt(rng, n) for rid, (n, _) in specs.items()}
    core = make_core(M, max_num_batched_tokens=7, max_model_len=64, num_kv_blocks=40)
    try:
        run = run_to_completion(core, [req(rid, prompts[rid], sp) for rid, (_, sp) in specs.items()])
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    # The prompts were split over several steps.
    assert sum(1 for s in run.steps if "g" in s.num_scheduled_tokens) > 29 // 7
    for rid, (_, sp) in specs.items():
        if rid == "one":
            assert run[rid].prompt_logprobs is None or len(run[rid].prompt_logprobs.ranks) == 0
            continue
        _check_request_logprobs(rid, prompts[rid], run[rid], sp.logprobs, sp.prompt_logprobs)
    # Sampled (non-greedy) tokens have ranks > 1 somewhere: ranks are real, not constant.
    assert int(np.max(run["s"].logprobs.ranks)) > 1
    assert all(int(x) == 1 for x in run["g"].logprobs.ranks)


def test_prompt_logprobs_with_prefix_cached_and_after_preemption() -> None:
    rng = random.Random(6)
    prefix = random_prompt(rng, 40)
    first, second = prefix + random_prompt(rng, 3), robust_prompt(M, rng, 9, 5, prefix)
    core = make_core(M, block_size=8, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=64)
    try:
        run_to_completion(core, [req("warm", first, greedy(4))])
        run = run_to_completion(core, [req("lp", second, greedy(5, logprobs=5, prompt_logprobs=3))])
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    # The prefix was in the cache; the prompt logprobs are still complete and right.
    _check_request_logprobs("lp", second, run["lp"], 5, 3)
    assert_greedy_equal(run["lp"].tokens, hf_generate(M, second, 5), "lp")

    # Preempted mid-prefill: rows already sent must not come twice, none may be missing.
    prompts = {"big": random_prompt(rng, 30), "lp2": random_prompt(rng, 44)}
    core = make_core(M, block_size=8, max_num_batched_tokens=12, max_model_len=64, num_kv_blocks=8)
    try:
        run = run_to_completion(core, [req("big", prompts["big"], greedy(34)),
                                       req("lp2", prompts["lp2"], greedy(4, logprobs=3, prompt_logprobs=3))])
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    assert run.stats.num_preemptions > 0
    for rid, sp_k, sp_pk in (("big", None, None), ("lp2", 3, 3)):
        _check_request_logprobs(rid, prompts[rid], run[rid], sp_k, sp_pk)


# ------------------------------------------------------------------ randomized invariants


def _random_params(rng: random.Random, max_tokens: int) -> SamplingParams:
    """Greedy or seeded sampling, sometimes with logprobs / prompt logprobs."""
    kw: dict = dict(max_tokens=max_tokens, ignore_eos=True)
    if rng.random() < 0.5:
        kw.update(temperature=0.0)
    else:
        kw.update(temperature=rng.uniform(0.5, 1.5), top_p=rng.choice([1.0, 0.9, 0.5]),
                  top_k=rng.choice([0, 5, 50]), seed=rng.randrange(1 << 31))
    if rng.random() < 0.3:
        kw.update(logprobs=rng.randint(0, 4))
    if rng.random() < 0.2:
        kw.update(prompt_logprobs=rng.randint(0, 3))
    return SamplingParams(**kw)


@pytest.mark.parametrize("case", range(16))
def test_randomized_invariants(case: int) -> None:
    """Random budgets, max_num_seqs, pools, block sizes, prompts (some sharing a prefix),
    joins and aborts. Per step: budget and max_num_seqs hold. Per request: exactly max_tokens
    (ignore_eos) unless aborted, complete prompt logprobs, and the same tokens as a plain
    reference run (greedy: up to numerical near-ties; seeded sampling: exactly)."""
    rng = random.Random(1000 + case)
    bs = rng.choice([1, 2, 4, 8, 16])
    max_model_len = rng.choice([48, 64, 96])
    chunked = rng.random() < 0.8
    budget = rng.randint(1, 40) if chunked else max_model_len
    max_seqs = rng.randint(1, 6)
    min_blocks = -(-max_model_len // bs)
    blocks = rng.randint(min_blocks, 2 * min_blocks)
    caching = rng.random() < 0.7
    shared = random_prompt(rng, rng.randint(1, 40))
    reqs = []
    for i in range(rng.randint(3, 10)):
        max_tokens = rng.randint(1, 16)
        n = rng.randint(1, max_model_len - max_tokens)
        prompt = (shared + random_prompt(rng, n))[:n] if rng.random() < 0.4 else random_prompt(rng, n)
        reqs.append(req(f"q{i}", prompt, _random_params(rng, max_tokens)))
    initial = [r for r in reqs if rng.random() < 0.6] or reqs[:1]
    joins: dict[int, list] = {}
    for r in reqs:
        if r not in initial:
            joins.setdefault(rng.randint(1, 15), []).append(r)
    aborts: dict[int, list[str]] = {}
    for r in reqs:
        if rng.random() < 0.2:
            aborts.setdefault(rng.randint(0, 30), []).append(r.request_id)

    core = make_core("micro", block_size=bs, max_model_len=max_model_len, max_num_batched_tokens=budget,
                     max_num_seqs=max_seqs, num_kv_blocks=blocks, enable_prefix_caching=caching,
                     enable_chunked_prefill=chunked)
    try:
        limit = core.scheduler.max_num_batched_tokens
        run = run_to_completion(core, initial, joins=joins, aborts=aborts)
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    for s in run.steps:
        assert 0 < s.total <= limit, s
        assert s.total == sum(s.num_scheduled_tokens.values())
        assert len(s.num_scheduled_tokens) <= max_seqs and s.num_running <= max_seqs, s
        assert s.stats.num_free_blocks >= 0
    aborted_ids = {rid for ids in aborts.values() for rid in ids}

    # Reference: the same requests in one roomy engine (no chunking, preemption or cache),
    # with top-2 logprobs to tell a real divergence from a numerical near-tie.
    ref_core = make_core("micro", block_size=16, max_model_len=max_model_len, num_kv_blocks=64,
                         max_num_seqs=16, enable_prefix_caching=False)
    try:
        ref = run_to_completion(ref_core, [
            req(r.request_id, r.prompt_token_ids, r.sampling_params.clone(logprobs=2)) for r in reqs])
    finally:
        ref_core.shutdown()

    for r in reqs:
        rid, got, sp = r.request_id, run[r.request_id], r.sampling_params
        want = ref[rid].tokens
        if rid in aborted_ids and got.finish_reason == FinishReason.ABORT:
            assert len(got.tokens) <= sp.max_tokens
            want = want[: len(got.tokens)]
        else:
            assert got.finish_reason == FinishReason.LENGTH, (rid, got.finish_reason)
            assert len(got.tokens) == sp.max_tokens, rid
            if sp.prompt_logprobs is not None:
                plp = got.prompt_logprobs
                assert (0 if plp is None else len(plp.ranks)) == len(r.prompt_token_ids) - 1, rid
            if sp.logprobs is not None:
                assert got.logprobs is not None and got.logprobs.token_ids.shape == (sp.max_tokens, sp.logprobs + 1)
        if got.tokens != want:
            i = next(j for j, (a, b) in enumerate(zip(got.tokens, want)) if a != b)
            lp = ref[rid].logprobs.logprobs
            gap = float(lp[i, 1] - lp[i, 2])
            assert sp.temperature == 0.0 and gap < 1e-4, (
                f"{rid} ({sp}): diverged at output {i} from the reference (top-2 gap {gap:.3g})")


# ------------------------------------------------------------------ stops


def _ends_on(prompt: list[int], t: int, m: int) -> bool:
    ref = hf_generate(M, prompt, 16, eos=t, min_tokens=m)
    return ref.tokens[-1] == t and m < len(ref.tokens) < 16 and min(ref.gaps) >= 1e-3


def test_stop_conditions() -> None:
    rng = random.Random(8)
    prompt = robust_prompt(M, rng, 20, 16)
    base = hf_generate(M, prompt, 16).tokens
    # j: the first output token not seen before it (so "stop at it" is unambiguous)
    j = next(i for i in range(2, 16) if base[i] not in base[:i])
    k = next(i for i in range(j + 1, 16) if base[i] not in base[:i])
    eos, stop_id = base[j], base[k]
    never = next(i for i in range(3, 512) if i not in base)  # a stop id that greedy never emits
    # min_tokens: a token t that greedy emits early, and a min_tokens m past its first
    # emission such that the run with t forbidden before m still ends on t (after m).
    t, m = next((t, m) for t in dict.fromkeys(base) for m in range(base.index(t) + 1, 12)
                if _ends_on(prompt, t, m))
    cases = {
        "eos": req("eos", prompt, greedy(16, ignore_eos=False), eos=eos),
        "ignore_eos": req("ignore_eos", prompt, greedy(16, ignore_eos=True), eos=eos),
        "stop_id": req("stop_id", prompt, greedy(16, ignore_eos=False, stop_token_ids=[stop_id, never]), eos=None),
        "min_eos": req("min_eos", prompt, greedy(16, ignore_eos=False, min_tokens=m), eos=t),
        "min_stop": req("min_stop", prompt, greedy(16, ignore_eos=False, min_tokens=m, stop_token_ids=[t]), eos=None),
        "min_ignored": req("min_ignored", prompt, greedy(16, ignore_eos=True, min_tokens=m), eos=t),
        "cap": req("cap", robust_prompt(M, rng, 50, 14), greedy(None)),  # max_model_len caps it
        "cap_eos": req("cap_eos", prompt, SamplingParams(temperature=0.0, max_tokens=None), eos=eos),
    }
    core = make_core(M, max_model_len=64, max_num_batched_tokens=32, num_kv_blocks=32)
    try:
        run = run_to_completion(core, list(cases.values()))
        assert_all_blocks_free(core)
    finally:
        core.shutdown()

    r = run["eos"]
    assert r.tokens == base[: j + 1] and r.finish_reason == FinishReason.STOP and r.stop_reason is None
    r = run["ignore_eos"]
    assert r.tokens == base and r.finish_reason == FinishReason.LENGTH and r.stop_reason is None
    r = run["stop_id"]
    assert r.tokens == base[: k + 1] and r.finish_reason == FinishReason.STOP and r.stop_reason == stop_id
    r = run["cap_eos"]
    assert r.tokens == base[: j + 1] and r.finish_reason == FinishReason.STOP

    # min_tokens: eos / stop ids are forbidden until then (as transformers' min_new_tokens),
    # and stop the request as soon as they are allowed again.
    want = hf_generate(M, prompt, 16, eos=t, min_tokens=m)
    assert t in base[:m] and want.tokens[-1] == t and m < len(want.tokens) < 16
    for rid, reason in (("min_eos", None), ("min_stop", t)):
        r = run[rid]
        assert_greedy_equal(r.tokens, want, rid)
        assert r.finish_reason == FinishReason.STOP and r.stop_reason == reason, (rid, r.stop_reason)
    # With ignore_eos, eos is still forbidden before min_tokens (vLLM), then allowed and ignored.
    r = run["min_ignored"]
    assert r.tokens[: len(want.tokens) - 1] == want.tokens[:-1] and len(r.tokens) == 16
    assert r.finish_reason == FinishReason.LENGTH and t in r.tokens[m:]

    r = run["cap"]
    assert len(r.tokens) == 64 - 50 and r.finish_reason == FinishReason.LENGTH
    assert_greedy_equal(r.tokens, hf_generate(M, cases["cap"].prompt_token_ids, 14), "cap")


def test_eos_only_after_min_tokens_when_it_is_greedy_first() -> None:
    """eos as the very first greedy token: min_tokens=0 stops at once, min_tokens=3 cannot."""
    rng = random.Random(9)
    prompt = robust_prompt(M, rng, 15, 8)
    first = hf_generate(M, prompt, 1).tokens[0]
    core = make_core(M, max_model_len=64, num_kv_blocks=16)
    try:
        run = run_to_completion(core, [req("now", prompt, greedy(8, ignore_eos=False), eos=first),
                                       req("later", prompt, greedy(8, ignore_eos=False, min_tokens=3), eos=first)])
    finally:
        core.shutdown()
    assert run["now"].tokens == [first] and run["now"].finish_reason == FinishReason.STOP
    assert first not in run["later"].tokens[:3] and len(run["later"].tokens) >= 3
    assert_greedy_equal(run["later"].tokens, hf_generate(M, prompt, 8, eos=first, min_tokens=3), "later")


# ------------------------------------------------------------------ sampler through the engine


def test_repetition_penalty_and_top_k_1_match_transformers() -> None:
    """Greedy with repetition_penalty (over prompt and output, as vLLM and transformers) and
    seeded sampling with top_k=1 (must equal greedy), in one chunked batch."""
    rng = random.Random(12)
    prompts = {f"r{i}": robust_prompt(M, rng, n, 16) for i, n in enumerate([4, 30, 61])}
    model = hf_model(M)
    want_rep = {}
    for rid, p in prompts.items():
        ids = torch.tensor([p])
        with torch.no_grad():
            g = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=16,
                               repetition_penalty=1.5, output_scores=True, return_dict_in_generate=True)
        want_rep[rid] = Ref(g.sequences[0, len(p):].tolist(), torch.stack(g.scores)[:, 0])  # penalised
    reqs = [req(rid, p, greedy(16, repetition_penalty=1.5)) for rid, p in prompts.items()]
    reqs += [req(rid + "k1", p, SamplingParams(temperature=0.7, top_k=1, seed=5, max_tokens=16, ignore_eos=True))
             for rid, p in prompts.items()]
    core = make_core(M, max_num_batched_tokens=20, max_model_len=128, num_kv_blocks=40)
    try:
        run = run_to_completion(core, reqs)
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    for rid, p in prompts.items():
        assert_greedy_equal(run[rid].tokens, want_rep[rid], rid + " repetition_penalty")
        assert run[rid].tokens != hf_generate(M, p, 16).tokens  # the penalty did something
        assert_greedy_equal(run[rid + "k1"].tokens, hf_generate(M, p, 16), rid + " top_k=1")


# ------------------------------------------------------------------ bad requests


def test_bad_requests_get_error_outputs_and_disturb_nothing() -> None:
    rng = random.Random(10)
    good = {"g1": robust_prompt(M, rng, 20, 10), "g2": robust_prompt(M, rng, 33, 10)}
    bad = [
        req("empty", [], greedy(4)),
        req("oov", [5, 512, 7], greedy(4)),
        req("neg", [5, -1], greedy(4)),
        req("too_long", random_prompt(rng, 70), greedy(4)),
        req("many_lp", [5, 6], greedy(4, logprobs=21)),
        req("many_plp", [5, 6], greedy(4, prompt_logprobs=21)),
        req("n2", [5, 6], SamplingParams(n=2, max_tokens=4)),
        req("g1", [5, 6, 7], greedy(4)),  # id of a running request
    ]
    core = make_core(M, max_model_len=64, max_num_batched_tokens=16, num_kv_blocks=16)
    try:
        run = run_to_completion(core, [req(rid, p, greedy(10)) for rid, p in good.items()],
                                joins={2: bad[:4], 4: bad[4:]})
        assert_all_blocks_free(core)
        assert core.scheduler.make_stats().num_preemptions == 0
    finally:
        core.shutdown()
    assert {e.request_id for e in run.errors} == {r.request_id for r in bad}
    for e in run.errors:
        assert e.finish_reason == FinishReason.ERROR and e.error, e
        assert e.new_token_ids == []
    for r in bad[:-1]:
        assert run[r.request_id].finish_reason == FinishReason.ERROR
        assert run[r.request_id].tokens == []
    for rid, prompt in good.items():
        assert run[rid].finish_reason == FinishReason.LENGTH
        assert_greedy_equal(run[rid].tokens, hf_generate(M, prompt, 10), rid)
    # Nothing bad reached the scheduler.
    assert all(rid in good for s in run.steps for rid in s.num_scheduled_tokens)
