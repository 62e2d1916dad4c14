"""Quarantine of crash suspects (core/quarantine.py, OutputProcessor.resume_after_crash): a
quarantined request runs in steps of its own until its first token; the front-end blames only
the requests of the step that failed, and gives one up only after it crashed the engine while
running alone twice without progress."""
from __future__ import annotations

import random

from tidal.core.request import RequestStatus
from tidal.frontend.output_processor import OutputProcessor
from tidal.protocol import SamplingParams
from tidal.protocol.messages import EngineCoreEventType, EngineCoreOutput, EngineCoreRequest, FinishReason

try:
    from test_scheduler import FakeRunner, assert_pool_empty, make_req, make_sched, reference_tokens, run_steps
except ImportError:  # tests/ made a package
    from tests.test_scheduler import (  # type: ignore[no-redef]
        FakeRunner, assert_pool_empty, make_req, make_sched, reference_tokens, run_steps)

GIVE_UP = "request was in flight during repeated engine failures"


def quarantined_req(rid: str, prompt: list[int], **sp: object):
    r = make_req(rid, prompt, **sp)
    r.quarantined = True
    return r


# ------------------------------------------------------------------ scheduler


def test_quarantined_request_runs_alone_until_its_first_token() -> None:
    sched = make_sched(max_num_batched_tokens=64)
    sched.add_request(make_req("A", list(range(1, 9)), max_tokens=4))
    sched.add_request(quarantined_req("Q", list(range(20, 30)), max_tokens=4))
    sched.add_request(make_req("B", list(range(40, 46)), max_tokens=4))
    steps, tokens = [], {}
    for so, outs in run_steps(sched, FakeRunner(4)):
        steps.append(dict(so.num_scheduled_tokens))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    # Q's first step is its own (it samples its first token there); then it runs with the others.
    assert steps[0] == {"Q": 10}
    assert steps[1] == {"Q": 1, "A": 8, "B": 6}
    assert not sched.quarantine
    for rid, prompt in (("A", list(range(1, 9))), ("Q", list(range(20, 30))), ("B", list(range(40, 46)))):
        assert tokens[rid] == reference_tokens(prompt, 4)
    assert_pool_empty(sched)


def test_quarantined_chunked_prefill_stays_alone_and_steps_alternate() -> None:
    # Q's prompt takes three chunks: each is a step of its own, and the others' steps
    # alternate with them; a second quarantined request waits for Q's first token.
    sched = make_sched(max_num_batched_tokens=8, num_kv_blocks=128)
    sched.add_request(quarantined_req("Q", list(range(1, 21)), max_tokens=3))
    sched.add_request(make_req("A", [5, 6, 7], max_tokens=6))
    sched.add_request(quarantined_req("R", [9, 9, 9, 9], max_tokens=3))
    steps, tokens = [], {}
    for so, outs in run_steps(sched, FakeRunner(4)):
        steps.append(dict(so.num_scheduled_tokens))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    q_steps = [i for i, s in enumerate(steps) if "Q" in s]
    r_steps = [i for i, s in enumerate(steps) if "R" in s]
    first_q_token = q_steps[2]  # 8 + 8 + 4 prompt tokens: the third chunk samples
    first_r_token = r_steps[0]
    for i in q_steps[:3]:
        assert set(steps[i]) == {"Q"}
    assert set(steps[first_r_token]) == {"R"} and first_r_token > first_q_token
    assert steps[0] == {"Q": 8} and steps[1] == {"A": 3}  # alternating: solo, the others, solo
    assert steps[2] == {"Q": 8} and set(steps[3]) == {"A"}
    assert tokens["Q"] == reference_tokens(list(range(1, 21)), 3)
    assert tokens["A"] == reference_tokens([5, 6, 7], 6)
    assert tokens["R"] == reference_tokens([9, 9, 9, 9], 3)
    assert not sched.quarantine
    assert_pool_empty(sched)


def test_no_quarantine_no_change_and_abort_lifts_it() -> None:
    sched = make_sched()
    sched.add_request(quarantined_req("Q", [1, 2, 3], max_tokens=3))
    sched.add_request(make_req("A", [4, 5], max_tokens=3))
    assert len(sched.quarantine) == 1
    sched.finish_requests("Q", RequestStatus.FINISHED_ABORTED)
    assert not sched.quarantine
    so = sched.schedule()
    assert so.num_scheduled_tokens == {"A": 2}


def test_quarantine_randomized_never_shares_a_step() -> None:
    for seed in range(20):
        rng = random.Random(seed)
        sched = make_sched(max_num_batched_tokens=rng.choice([6, 16, 64]), max_num_seqs=rng.choice([2, 4, 8]),
                           num_kv_blocks=rng.choice([40, 128]))
        prompts = {}
        for i in range(12):
            rid = f"r{i}"
            prompts[rid] = [rng.randrange(1, 50) for _ in range(rng.randrange(1, 30))]
            make = quarantined_req if rng.random() < 0.4 else make_req
            sched.add_request(make(rid, prompts[rid], max_tokens=rng.randrange(1, 8)))
        quarantined = {r.request_id for r, _ in sched.quarantine.requests.values()}
        got_token: set[str] = set()
        tokens: dict[str, list[int]] = {}
        for so, outs in run_steps(sched, FakeRunner(4)):
            in_q = [rid for rid in so.num_scheduled_tokens if rid in quarantined and rid not in got_token]
            if in_q:
                assert list(so.num_scheduled_tokens) == in_q, (seed, so.num_scheduled_tokens)
            for o in outs:
                if o.new_token_ids:
                    got_token.add(o.request_id)
                tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            assert len(sched.running) <= sched.max_num_seqs
        for rid, prompt in prompts.items():
            assert tokens[rid] == reference_tokens(prompt, sched_max := len(tokens[rid])) and sched_max >= 1
        assert not sched.quarantine
        assert_pool_empty(sched)


# ------------------------------------------------------------------ front-end


def _op(n: int) -> OutputProcessor:
    op = OutputProcessor(None)
    for i in range(n):
        op.add_request(EngineCoreRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=50, detokenize=False)), None)
    return op


def _token(op: OutputProcessor, rid: str) -> None:
    op.process_outputs([EngineCoreOutput(rid, new_token_ids=[7])])


def test_innocents_outside_the_failing_step_are_never_given_up() -> None:
    op = _op(4)
    for crash in range(10):  # r0 always in the failing step and never progressing; r1-r3 queued
        resend, give_up = op.resume_after_crash(["r0"] if crash < 1 else [])
        assert not give_up
        assert {r.request_id for r in resend} == {"r0", "r1", "r2", "r3"}
        assert [r.request_id for r in resend if r.quarantined] == ["r0"]


def test_batch_suspects_quarantined_and_cleared_by_progress() -> None:
    op = _op(3)
    resend, give_up = op.resume_after_crash(["r0", "r1", "r2"])
    assert not give_up and all(r.quarantined for r in resend)
    _token(op, "r1")
    resend, give_up = op.resume_after_crash(["r0"])  # r0 ran alone and the engine died: one strike
    assert not give_up
    by_id = {r.request_id: r for r in resend}
    assert by_id["r0"].quarantined and by_id["r2"].quarantined and not by_id["r1"].quarantined
    assert resend[0].request_id == "r0"  # struck: resent first, runs first
    assert by_id["r1"].resumed_output_token_ids == [7]
    # A coincidence strikes once; progress clears it.
    _token(op, "r0")
    resend, give_up = op.resume_after_crash(["r2"])
    assert not give_up and {r.request_id: r.quarantined for r in resend} == {"r0": False, "r1": False, "r2": True}


def test_request_crashing_alone_twice_is_given_up() -> None:
    op = _op(3)
    resend, give_up = op.resume_after_crash(["r0", "r1"])  # a batch crash: both suspects
    assert not give_up
    _token(op, "r1")  # r1 ran alone and made progress; r2 kept going
    _token(op, "r2")
    resend, give_up = op.resume_after_crash(["r0"])  # r0 alone: strike one
    assert not give_up
    resend, give_up = op.resume_after_crash(["r0"])  # alone again: proven
    assert [o.request_id for o in give_up] == ["r0"]
    assert give_up[0].finish_reason == FinishReason.ERROR and give_up[0].error == GIVE_UP
    assert {r.request_id for r in resend} == {"r1", "r2"}
    out = op.process_outputs(give_up)
    assert "r0" not in op.request_states and out is not None


def _started(op: OutputProcessor, rid: str) -> None:
    """The core's announcement that a request's first step begins (EngineCore._announce_started)."""
    op.process_outputs([EngineCoreOutput(rid, events=[(int(EngineCoreEventType.SCHEDULED), 1.0)])])


def test_unknown_failing_step_blames_started_requests_without_progress() -> None:
    op = _op(2)
    _started(op, "r0")
    _token(op, "r1")
    resend, give_up = op.resume_after_crash(None)  # r0 ran and made no progress: a suspect
    assert not give_up and not any(r.quarantined for r in resend)
    _started(op, "r0")
    _token(op, "r1")
    resend, give_up = op.resume_after_crash(None)  # no progress across two crashes in a row
    assert [o.request_id for o in give_up] == ["r0"] and give_up[0].error == GIVE_UP
    assert [r.request_id for r in resend] == ["r1"]


def test_unknown_failing_step_never_blames_a_request_that_never_ran() -> None:
    # r0 runs and streams through every crash; r1 sits in the queue behind it (never started
    # on any core); r2 started on the second core only. A queued request is not a suspect.
    op = _op(3)
    for crash in range(6):
        _started(op, "r0")
        _token(op, "r0")
        if crash == 1:
            _started(op, "r2")
        resend, give_up = op.resume_after_crash(None)
        assert not give_up, (crash, [o.request_id for o in give_up])
        assert {r.request_id for r in resend} == {"r0", "r1", "r2"}
    # r2 was a suspect once (crash 1), then queued through the rest: its streak stands at one,
    # and the next crash it runs through without progress gives it up.
    _started(op, "r2")
    resend, give_up = op.resume_after_crash(None)
    assert [o.request_id for o in give_up] == ["r2"] and give_up[0].error == GIVE_UP
    assert {r.request_id for r in resend} == {"r0", "r1"}
    # The announcement leaves no trace in the streams: r1 never produced an output.
    assert op.request_states["r1"].token_ids == [] and op.request_states["r1"].text == ""


# ------------------------------------------------------------------ engine core


def test_failed_step_names_each_front_ends_requests(monkeypatch) -> None:
    """A step that raises (every row's sampling fails: no single culprit) leaves the step's
    requests known, by front-end and with its ids, for the engine_dead message; the
    `quarantined` flag of a resubmitted request reaches the scheduler."""
    import pytest

    from engine_utils import make_core, req
    from fault_injection import use_sampling_fault

    use_sampling_fault(monkeypatch, 7)
    core = make_core("tiny")
    assert core.failed_step_request_ids() is None  # no step ran
    params = SamplingParams(max_tokens=4, temperature=0.0)
    core.add_request(req("a", [3, 7, 4], params), b"fe-1")
    core.add_request(req("b", [5, 7, 6], params), b"fe-2")
    core.add_request(req("a", [8, 7, 9], params), b"fe-2")
    with pytest.raises(IndexError, match="injected sampling failure"):
        for _ in range(5):
            core.step()
    failed = core.failed_step_request_ids()
    assert failed is not None
    assert {k: sorted(v) for k, v in failed.items()} == {b"fe-1": ["a"], b"fe-2": ["a", "b"]}

    core2 = make_core("tiny")
    core2.add_request(EngineCoreRequest("q", [1, 2, 3], params, quarantined=True), b"fe-1")
    (request,) = core2.scheduler.requests.values()
    assert request.quarantined and len(core2.scheduler.quarantine) == 1
