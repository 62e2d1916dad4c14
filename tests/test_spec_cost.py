"""Speculation pays or steps aside (issue 33 item 4): core/spec_cost.py's rule on synthetic
step timings (no model), how SpecDecoder reads a step's shape, and one engine run where the rule
pauses and resumes speculation mid-request with tokens identical to speculation off."""
from __future__ import annotations

from typing import Iterator

import pytest

from engine_utils import assert_all_blocks_free, greedy, make_core, req, run_to_completion
from test_spec_decode import CORE_KW, SPEC, assert_same, draft_model, model, repeating_prompts, spec_config  # noqa: F401
from tidal.core import spec_cost
from tidal.core.engine_core import EngineCore
from tidal.core.spec_cost import MAX_SPEC_PROBE, PLAIN_PROBE, SPEC_PROBE, WINDOW, SpecCost
from tidal.core.spec_decode import SpecDecoder
from tidal.protocol import SamplingParams
from tidal.protocol.messages import SchedulerOutput


def drive(cost: SpecCost, steps: int, ratio: float, accepted_per_row: float, rows: int = 1,
          k: int = 4, proposes: bool = True) -> float:
    """Run `steps` pure decode steps of `rows` requests: a plain one takes 1.0 s, a speculative
    one `ratio` s and gains `accepted_per_row` tokens a row (k proposals a row; `proposes`
    False: the step gets none though the rule allowed them). The share of steps speculated."""
    on_steps = 0
    for _ in range(steps):
        on = cost.speculate(rows) and proposes
        on_steps += on
        if on:
            cost.observe(ratio, rows, rows * k, round(accepted_per_row * rows))
        else:
            cost.observe(1.0, rows, 0, 0)
    return on_steps / steps


def test_costly_verification_with_low_acceptance_pauses() -> None:
    # 3x the cost for 1.2 tokens a step: loses. Only the probes speculate.
    cost = SpecCost()
    share = drive(cost, 340, ratio=3.0, accepted_per_row=0.2)
    assert share <= 1 / SPEC_PROBE + 0.02
    assert share > 0  # it keeps probing
    # Probes that keep losing come ever more rarely, down to one each MAX_SPEC_PROBE steps.
    share = drive(cost, 8 * MAX_SPEC_PROBE, ratio=3.0, accepted_per_row=0.2)
    assert 0 < share <= 1.5 / MAX_SPEC_PROBE


def test_cheap_verification_with_high_acceptance_speculates() -> None:
    # 1.2x the cost for ~4.6 tokens a step: wins. Only the plain probes pause it.
    cost = SpecCost()
    share = drive(cost, 340, ratio=1.2, accepted_per_row=3.6)
    assert share >= 1 - 1 / PLAIN_PROBE - 0.02
    assert share < 1  # the plain time is refreshed too


def test_break_even_within_the_margin_pauses() -> None:
    # 2x the cost for 2.05x the tokens: within the 5% margin, not worth the noise.
    assert drive(SpecCost(), 200, ratio=2.0, accepted_per_row=1.05) <= 1 / SPEC_PROBE + 0.02


def test_after_a_pause_it_probes_and_resumes_when_costs_change() -> None:
    cost = SpecCost()
    assert drive(cost, 200, ratio=3.0, accepted_per_row=0.2) < 0.1
    # Verification got cheap and acceptance high: the next probes see it and it turns back on.
    # The first one within MAX_SPEC_PROBE steps; it pays, so the next come each SPEC_PROBE.
    drive(cost, MAX_SPEC_PROBE + (WINDOW // 2 + 2) * SPEC_PROBE, ratio=1.2, accepted_per_row=3.6)
    assert drive(cost, 100, ratio=1.2, accepted_per_row=3.6) > 0.9
    # And back off when it stops paying (speculative steps keep measuring while on).
    drive(cost, 30, ratio=3.0, accepted_per_row=0.2)
    assert drive(cost, 100, ratio=3.0, accepted_per_row=0.2) < 0.1


def test_plain_time_is_refreshed_while_every_request_proposes() -> None:
    # Speculating on (a draft model proposes for everyone): a plain step every PLAIN_PROBE steps
    # re-measures the plain time, so a cheaper plain step (here 1.0 -> 0.4 s) turns it off.
    cost = SpecCost()
    drive(cost, 100, ratio=1.5, accepted_per_row=1.0)  # gain 2.0 > 1.5: on
    assert cost.speculate(1)
    for _ in range(10 * PLAIN_PROBE):
        if cost.speculate(1):
            cost.observe(1.5, 1, 4, 1)
        else:
            cost.observe(0.4, 1, 0, 0)  # ratio now 3.75 > gain 2.0
    assert drive(cost, 100, ratio=1.5 / 0.4, accepted_per_row=1.0) < 0.1


def test_steps_without_proposals_are_plain_samples() -> None:
    # The n-gram found nothing: those steps measure the plain time; nothing breaks.
    cost = SpecCost()
    assert drive(cost, 50, ratio=3.0, accepted_per_row=0.0, proposes=False) == 0
    b = cost.buckets[1]
    assert list(b.plain_s) == [1.0] * WINDOW and not b.spec_s
    assert cost.speculate(1)  # never measured speculating: it tries


def test_batch_size_buckets_decide_apart() -> None:
    # Verifying is cheap at batch 1, dear at batch 16 (as on CPU): on at 1, off at 16.
    cost = SpecCost()
    for _ in range(200):
        for rows, ratio in ((1, 1.2), (16, 3.0)):
            if cost.speculate(rows):
                cost.observe(ratio, rows, rows * 4, rows)  # 1 accepted a row: gain 2.0
            else:
                cost.observe(1.0, rows, 0, 0)
    assert cost.speculate(1)
    assert drive(cost, 100, ratio=3.0, accepted_per_row=1.0, rows=16) < 0.1
    assert spec_cost.bucket(16) != spec_cost.bucket(1) and spec_cost.bucket(5) == spec_cost.bucket(7)


def test_observe_step_reads_the_shape_and_skips_prefill() -> None:
    spec = SpecDecoder(SPEC, max_model_len=256)
    seen: list[tuple] = []
    spec.cost.observe = lambda *a: seen.append(a)  # type: ignore[method-assign]
    spec.record(3, 2)  # a's draft: 2 of 3 accepted
    spec.observe_step(SchedulerOutput(num_scheduled_tokens={"a": 4, "b": 1},
                                      scheduled_spec_decode_tokens={"a": [5, 6, 7]}), 0.5)
    assert seen == [(0.5, 2, 3, 2)]
    spec.record(1, 0)
    spec.observe_step(SchedulerOutput(num_scheduled_tokens={"a": 2, "b": 16},  # b: a prefill chunk
                                      scheduled_spec_decode_tokens={"a": [5]}), 0.5)
    spec.observe_step(SchedulerOutput(scheduled_new_reqs=[object()], num_scheduled_tokens={"b": 1}), 0.5)
    assert len(seen) == 1  # neither measured
    spec.observe_step(SchedulerOutput(num_scheduled_tokens={"a": 1}), 0.25)
    assert seen[-1] == (0.25, 1, 0, 0)  # the skipped step's acceptance did not leak into this one


# ------------------------------------------------------------------ engine: tokens unchanged


@pytest.fixture(scope="module")
def core_off(model: str) -> Iterator[EngineCore]:
    core = make_core(model, **CORE_KW)
    yield core
    core.shutdown()


DEAR_STEPS = 15


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_pausing_and_resuming_mid_request_keeps_the_tokens(model: str, draft_model: str, core_off: EngineCore,
                                                           kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculative steps are made to look 5x as dear as plain ones for the first DEAR_STEPS
    steps (the rule pauses, probing every 4 steps), then as cheap: it resumes. Tokens equal
    speculation off."""
    monkeypatch.setattr(spec_cost, "SPEC_PROBE", 4)
    monkeypatch.setenv("TIDAL_SPEC_COST_RULE", "1")  # tests/conftest.py turns it off elsewhere
    core = make_core(model, speculative_config=spec_config(kind, draft_model), **CORE_KW)
    try:
        spec = core.scheduler.spec
        assert spec is not None
        real_observe, steps, accepted_when_dear = spec.cost.observe, [0], [0]

        def observe(seconds: float, rows: int, proposal_rows: int, accepted: int) -> None:
            steps[0] += 1
            dear = 5.0 if steps[0] <= DEAR_STEPS else 1.0
            if steps[0] == DEAR_STEPS:
                accepted_when_dear[0] = spec.num_accepted_tokens
            real_observe(dear if proposal_rows else 1.0, rows, proposal_rows, accepted)

        spec.cost.observe = observe  # type: ignore[method-assign]
        prompts = repeating_prompts(7, 3)
        requests = [req(f"r{i}", p, greedy(80) if i % 2 else SamplingParams(temperature=0.8, seed=i, max_tokens=80,
                                                                           ignore_eos=True))
                    for i, p in enumerate(prompts)]
        off = run_to_completion(core_off, requests)
        on = run_to_completion(core, requests)
        assert_same(off, on)
        assert_all_blocks_free(core)
        assert steps[0] > DEAR_STEPS and spec.cost.num_paused_steps > 0  # it paused ...
        assert spec.num_accepted_tokens > accepted_when_dear[0]  # ... and resumed
    finally:
        core.shutdown()
