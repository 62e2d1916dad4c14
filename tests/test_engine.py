"""EngineCore on one device, in-process, against transformers (float32, CPU).

Issue "Engine on one device": greedy tokens identical to `generate` for Llama/Qwen2/Qwen3
shapes in one mixed prefill/decode batch, requests joining mid-flight, every block back in the
pool after finishes and aborts, and seeded sampling independent of the batch.
"""
from __future__ import annotations

import random

import pytest

from engine_utils import (
    EOS,
    MODELS,
    assert_all_blocks_free,
    assert_greedy_equal,
    greedy,
    hf_generate,
    make_core,
    random_prompt,
    robust_prompt,
    req,
    run_to_completion,
)
from tidal.protocol import SamplingParams
from tidal.protocol.messages import EngineCoreEventType, EngineCoreRequest, FinishReason

HF_MODELS = [m for m in MODELS if m not in ("tiny", "tiny-4k", "micro")]


@pytest.mark.parametrize("name", HF_MODELS)
def test_greedy_mixed_batch_matches_transformers(name: str) -> None:
    """One batch of staggered prompt lengths (shorter than a block .. several blocks), a small
    token budget so prefill chunks ride along decodes, and requests joining mid-flight."""
    idx = HF_MODELS.index(name)
    block_size = 16 if idx % 2 == 0 else 8
    rng = random.Random(100 + idx)
    # (prompt length, max_tokens); the first 4 start together, the rest join later.
    shapes = [(3, 20), (13, 12), (70, 16), (37, 10), (5, 14), (52, 9), (block_size, 11)]
    prompts = {f"r{i}": robust_prompt(name, rng, n, m) for i, (n, m) in enumerate(shapes)}
    max_tokens = {f"r{i}": m for i, (_, m) in enumerate(shapes)}
    reqs = {rid: req(rid, p, greedy(max_tokens[rid])) for rid, p in prompts.items()}

    core = make_core(name, block_size=block_size, max_num_batched_tokens=24, max_model_len=256,
                     num_kv_blocks=128)
    try:
        run = run_to_completion(core, [reqs[f"r{i}"] for i in range(4)],
                                joins={5: [reqs["r4"], reqs["r5"]], 12: [reqs["r6"]]})
        assert_all_blocks_free(core)
    finally:
        core.shutdown()

    # The batch really mixed: prefill chunks beside decodes, a prompt split over steps.
    assert run.mixed_steps(), [s.num_scheduled_tokens for s in run.steps]
    assert any(s.num_scheduled_tokens.get("r2", 0) not in (0, 1, 70) for s in run.steps)
    assert all(s.total <= 24 for s in run.steps)
    for rid, prompt in prompts.items():
        r = run[rid]
        assert r.finish_reason == FinishReason.LENGTH and r.stop_reason is None, (rid, r.finish_reason)
        assert_greedy_equal(r.tokens, hf_generate(name, prompt, max_tokens[rid]), f"{name} {rid}")


def test_joins_mid_flight_and_after_idle() -> None:
    """Requests added after some steps (during others' prefill, during decode, and after the
    engine went idle) still match the reference; the idle engine steps as a no-op."""
    name = "llama-gqa-tied"
    rng = random.Random(7)
    lens = [40, 9, 25, 60, 2, 33]
    prompts = {f"j{i}": robust_prompt(name, rng, n, 8) for i, n in enumerate(lens)}
    sp = greedy(8)
    r = {rid: req(rid, p, sp) for rid, p in prompts.items()}
    core = make_core(name, max_num_batched_tokens=16, max_model_len=128, num_kv_blocks=64)
    try:
        run = run_to_completion(core, [r["j0"]], joins={1: [r["j1"]], 2: [r["j2"]], 6: [r["j3"]], 7: [r["j4"]]})
        assert_all_blocks_free(core)
        assert not core.has_unfinished_requests()
        assert core.step() == {}  # idle: no outputs, nothing to send
        run2 = run_to_completion(core, [r["j5"]], joins={2: [req("j0", prompts["j0"], sp)]})
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    for rid, prompt in prompts.items():
        got = run2[rid].tokens if rid == "j5" else run[rid].tokens
        assert_greedy_equal(got, hf_generate(name, prompt, 8), rid)
    # The reused id "j0" (after it finished) ran again and gave the same tokens.
    assert run2["j0"].tokens == run["j0"].tokens


def test_all_blocks_free_after_aborts() -> None:
    """Aborts of a waiting, a mid-prefill and a decoding request (and of unknown / finished
    ids) free every block, emit one ABORT output each, and leave the others exact."""
    name = "qwen3-gqa-tied"
    rng = random.Random(3)
    prompts = {f"a{i}": robust_prompt(name, rng, n, 12) for i, n in enumerate([30, 50, 12, 45, 20, 8])}
    reqs = [req(rid, p, greedy(12)) for rid, p in prompts.items()]
    core = make_core(name, max_num_batched_tokens=20, max_num_seqs=3, max_model_len=128, num_kv_blocks=40)
    try:
        total = core.scheduler.make_stats().num_total_blocks
        run = run_to_completion(core, reqs, aborts={
            # step 2: a0 decoding or finishing its prefill, a1 mid-prefill, a4 still waiting
            2: ["a1", "a4", "nope"],
            # step 8: a3 somewhere in flight; a0 decoding
            8: ["a3", "a0"],
        })
        assert_all_blocks_free(core)
        assert run.stats.num_free_blocks == total
        # aborting everything in flight at once also frees every block
        run2 = run_to_completion(core, reqs, aborts={3: list(prompts)})
        assert_all_blocks_free(core)
        assert all(r.finish_reason == FinishReason.ABORT for r in run2.results.values())
        # finished and unknown ids: nothing happens
        core.abort_requests(["a2", "zzz"])
        assert core.step() == {}
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    aborted = {"a1", "a4", "a3", "a0"}
    for rid, prompt in prompts.items():
        r = run[rid]
        ref = hf_generate(name, prompt, 12)
        if rid in aborted:
            assert r.finish_reason == FinishReason.ABORT, rid
            assert [o.finish_reason for o in r.outputs].count(FinishReason.ABORT) == 1
            # what it produced before the abort is a prefix of the reference
            assert r.tokens == ref.tokens[: len(r.tokens)], rid
        else:
            assert r.finish_reason == FinishReason.LENGTH, rid
            assert_greedy_equal(r.tokens, ref, rid)
    assert run["a4"].tokens == [] and run["a1"].tokens == []  # waiting / mid-prefill
    assert "nope" not in run.results


def test_request_id_reuse_right_after_finish_and_abort() -> None:
    """An id may be reused as soon as its request ended, even before the runner was told to
    drop its state (finish and re-add before the next step; abort and re-add likewise)."""
    name = "qwen2-gqa-tied"
    rng = random.Random(21)
    p1, p2, p3 = (robust_prompt(name, rng, n, m) for n, m in ((20, 1), (9, 5), (33, 6)))
    core = make_core(name, max_num_batched_tokens=64, max_model_len=128, num_kv_blocks=32)
    try:
        # X ends in step 0 (max_tokens=1) and comes back, with another prompt, before step 1.
        run = run_to_completion(core, [req("X", p1, greedy(1)), req("Y", p3, greedy(6))],
                                joins={1: [req("X", p2, greedy(5))]})
        assert_all_blocks_free(core)
        assert run.steps[1].new_reqs == ["X"]
        assert_greedy_equal(run["X"].tokens, hf_generate(name, p2, 5), "X reused")
        assert_greedy_equal(run["Y"].tokens, hf_generate(name, p3, 6), "Y")
        # Z aborted mid-decode and re-added under the same id before the next step.
        run = run_to_completion(core, [req("Z", p3, greedy(6)), req("Y", p1, greedy(1))],
                                aborts={3: ["Z"]}, joins={3: [req("Z", p2, greedy(5))]})
        assert_all_blocks_free(core)
        assert "Z" in run.steps[3].finished_req_ids and "Z" in run.steps[3].new_reqs
        assert run["Z"].finish_reason == FinishReason.LENGTH
        assert_greedy_equal(run["Z"].tokens, hf_generate(name, p2, 5), "Z reused")
    finally:
        core.shutdown()


def test_outputs_go_to_their_front_end() -> None:
    """Requests stamped with their front-end's identity: a step's outputs come grouped by it, ids
    are per front-end (two may use the same id; neither touches the other's request), a
    front-end aborts only its own requests, and the requests of one that is gone are freed
    without outputs."""
    core = make_core("tiny", max_model_len=64, num_kv_blocks=16)
    try:
        core.add_request(req("a1", [5, 6, 7], greedy(4)), b"fe-a")
        core.add_request(req("b1", [8, 9], greedy(4)), b"fe-b")
        core.add_request(req("a1", [5], greedy(4)), b"fe-b")  # fe-a's id, fe-b's own request
        core.add_request(req("b1", [5], greedy(4)), b"fe-b")  # in use by fe-b itself
        got = {c: [(o.request_id, o.finish_reason) for o in m.outputs] for c, m in core.step().items()}
        assert got == {b"fe-a": [("a1", None)], b"fe-b": [("b1", FinishReason.ERROR), ("b1", None), ("a1", None)]}
        core.abort_requests(["a1", "b1"], b"fe-b")  # fe-b's own a1 and b1 end; fe-a's a1 runs on
        got = {c: [(o.request_id, o.finish_reason) for o in m.outputs] for c, m in core.step().items()}
        assert got == {b"fe-a": [("a1", None)], b"fe-b": [("a1", FinishReason.ABORT), ("b1", FinishReason.ABORT)]}
        assert core.drop_client(b"fe-a") == 1
        assert core.step() == {} and not core.has_unfinished_requests()
        assert_all_blocks_free(core)
    finally:
        core.shutdown()


def test_abort_during_the_forward_pass_wins_over_the_step() -> None:
    """What arrives during the forward pass is applied (apply_input: the core process drains its
    input queue) before the step's outputs are built: an aborted request gets its one ABORT
    output and no token from the step it raced; the others are untouched."""
    core = make_core("tiny", max_model_len=64, num_kv_blocks=16)
    try:
        core.add_request(req("x", [5, 6, 7], greedy(8)))
        core.add_request(req("y", [8, 9], greedy(8)))
        core.step()
        core.apply_input = lambda: core.abort_requests(["x"])
        (msg,) = core.step().values()
        core.apply_input = None
        assert [(o.request_id, o.finish_reason, len(o.new_token_ids)) for o in msg.outputs] == [
            ("x", FinishReason.ABORT, 0), ("y", None, 1)]
        while core.has_unfinished_requests():
            assert all(o.request_id == "y" for m in core.step().values() for o in m.outputs)
        assert_all_blocks_free(core)
    finally:
        core.shutdown()


def _crowd(rng: random.Random, n: int, vocab: int) -> list:
    """Random requests with every kind of sampling knob (each seeded)."""
    out = []
    for i in range(n):
        kind = rng.randrange(5)
        kw: dict = dict(max_tokens=rng.randint(1, 30), seed=rng.randrange(1 << 30), ignore_eos=rng.random() < 0.7)
        if kind == 0:
            kw.update(temperature=0.0)
        elif kind == 1:
            kw.update(temperature=rng.uniform(0.3, 1.5), top_k=rng.randint(1, 50))
        elif kind == 2:
            kw.update(temperature=1.0, top_p=rng.uniform(0.2, 1.0), min_p=rng.uniform(0.0, 0.2))
        elif kind == 3:
            kw.update(temperature=0.7, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.3,
                      min_tokens=rng.randint(0, min(5, kw["max_tokens"])))
        else:
            kw.update(temperature=0.9, top_p=0.8, top_k=20, logprobs=rng.randint(0, 5))
        out.append(req(f"c{i}", random_prompt(rng, rng.randint(1, 60), vocab), SamplingParams(**kw)))
    return out


def test_seeded_sampling_alone_equals_crowded() -> None:
    """temperature 0.8, top_p 0.9, seed s: the same tokens alone, in a crowded batch of 20
    random requests (different batch slots, chunked prefill), and in a crowd that preempts."""
    name, vocab = "tiny-4k", 4096
    rng = random.Random(11)
    prompt = random_prompt(rng, 27, vocab)

    def target(rid: str = "target", seed: int = 1234) -> list:
        return [req(rid, prompt, SamplingParams(temperature=0.8, top_p=0.9, seed=seed, max_tokens=24,
                                                ignore_eos=True))]

    core = make_core(name, max_num_batched_tokens=2048, max_model_len=128, num_kv_blocks=200)
    try:
        alone = run_to_completion(core, target())["target"].tokens
        other_seed = run_to_completion(core, target(seed=4321))["target"].tokens
    finally:
        core.shutdown()
    assert len(alone) == 24 and len(other_seed) == 24
    assert alone != other_seed  # the seed matters

    crowd_rng = random.Random(12)
    crowd = _crowd(crowd_rng, 20, vocab)
    # Big pool: the target joins mid-flight, among prefill chunks and decodes.
    core = make_core(name, max_num_batched_tokens=40, max_model_len=128, num_kv_blocks=200)
    try:
        run = run_to_completion(core, crowd[:12], joins={2: target() + crowd[12:16], 5: crowd[16:]
                                                         + target("twin")})
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    assert run.mixed_steps()
    assert run["target"].tokens == alone
    assert run["twin"].tokens == alone
    # Tiny pool: the crowd preempts (the target too, or those around it); still the same.
    core = make_core(name, max_num_batched_tokens=32, max_model_len=128, num_kv_blocks=12,
                     disable_log_stats=False)  # events are recorded with stats only
    try:
        tight = run_to_completion(core, crowd[:10] + target() + crowd[10:])
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    assert tight.stats.num_preemptions > 0
    events = [e[0] for o in tight["target"].outputs for e in (o.events or [])]
    assert EngineCoreEventType.PREEMPTED in events  # the target itself was recomputed
    assert tight["target"].tokens == alone
    # The whole crowd is reproducible too (seeded), whatever the pool.
    for c in crowd:
        assert tight[c.request_id].tokens == run[c.request_id].tokens, c.request_id


def _preempted_ids(steps: list) -> list[str]:
    """Ids whose runner state was dropped while they still had steps to run: preemptions."""
    out = []
    for i, s in enumerate(steps):
        out += [rid for rid in s.finished_req_ids if any(rid in t.num_scheduled_tokens for t in steps[i:])]
    return out


def _prio_req(rid: str, prompt: list[int], max_tokens: int, priority: int, arrival: float) -> EngineCoreRequest:
    return EngineCoreRequest(rid, list(prompt), greedy(max_tokens), eos_token_id=EOS, arrival_time=arrival,
                             priority=priority)


def test_priority_policy_order_and_preemption() -> None:
    """scheduling_policy="priority" on the engine (vLLM's): with one seat, requests run in
    (priority, arrival) order whatever order they came in; when the KV pool runs dry, the
    lower-priority request is preempted, not the last admitted (FCFS preempts the latter).
    Tokens stay transformers' greedy ones throughout."""
    name = "qwen3-gqa-tied"
    rng = random.Random(21)
    prompts = {rid: robust_prompt(name, rng, n, 24) for rid, n in (("p2", 9), ("p0", 14), ("p1", 5), ("q0", 7))}
    order_reqs = [_prio_req("p2", prompts["p2"], 6, 2, 0.0), _prio_req("p0", prompts["p0"], 6, 0, 1.0),
                  _prio_req("p1", prompts["p1"], 6, 1, 2.0), _prio_req("q0", prompts["q0"], 6, 0, 3.0)]
    core = make_core(name, max_num_seqs=1, max_model_len=64, num_kv_blocks=16, scheduling_policy="priority")
    try:
        run = run_to_completion(core, order_reqs)
    finally:
        core.shutdown()
    assert [rid for s in run.steps for rid in s.new_reqs] == ["p0", "q0", "p1", "p2"]
    for rid, prompt in prompts.items():
        assert_greedy_equal(run[rid].tokens, hf_generate(name, prompt, 6), rid)

    # L (priority 1) then H (priority 0, one step later); 8 blocks of 8 cannot hold both.
    runs = {}
    for policy in ("priority", "fcfs"):
        low = _prio_req("L", prompts["p2"], 24, 1 if policy == "priority" else 0, 0.0)
        high = _prio_req("H", prompts["p0"], 20, 0, 1.0)
        core = make_core(name, max_model_len=64, block_size=8, num_kv_blocks=8, scheduling_policy=policy)
        try:
            runs[policy] = run_to_completion(core, [low], joins={1: [high]})
            assert_all_blocks_free(core)
        finally:
            core.shutdown()
        ref = {"L": hf_generate(name, prompts["p2"], 24), "H": hf_generate(name, prompts["p0"], 20)}
        for rid in ("L", "H"):
            assert_greedy_equal(runs[policy][rid].tokens, ref[rid], f"{policy} {rid}")
    prio, fcfs = runs["priority"], runs["fcfs"]
    assert prio.stats.num_preemptions >= 1 and set(_preempted_ids(prio.steps)) == {"L"}
    assert fcfs.stats.num_preemptions >= 1 and set(_preempted_ids(fcfs.steps)) == {"H"}
    # Under priority H never waits once admitted: it is scheduled every step until it finishes.
    h_steps = [i for i, s in enumerate(prio.steps) if "H" in s.num_scheduled_tokens]
    assert h_steps == list(range(h_steps[0], h_steps[0] + len(h_steps))) and len(h_steps) == 20


def test_priority_needs_the_priority_policy() -> None:
    """A non-zero priority under FCFS fails alone, with vLLM's message; 0 is fine."""
    core = make_core("tiny", max_model_len=64, num_kv_blocks=16)
    try:
        run = run_to_completion(core, [_prio_req("x", [5, 6], 2, 3, 0.0), _prio_req("y", [5, 6], 2, 0, 0.0)])
    finally:
        core.shutdown()
    assert [(e.request_id, e.error) for e in run.errors] == [
        ("x", "Got priority 3 but Priority scheduling is not enabled.")]
    assert run["y"].finish_reason == FinishReason.LENGTH
