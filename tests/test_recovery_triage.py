"""The pure triage after a crash (frontend/recovery.py): which requests to resend, which to
give up, and the records each resent request carries on, without a core or a socket."""
from __future__ import annotations

import dataclasses

from tidal.frontend.recovery import GIVE_UP_ERROR, ResumeRecord, give_up_output, triage
from tidal.protocol import SamplingParams
from tidal.protocol.messages import EngineCoreRequest, FinishReason


def rec(rid: str, **fields: object) -> ResumeRecord:
    return ResumeRecord(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=50)), **fields)  # type: ignore[arg-type]


def ids(records: list[ResumeRecord]) -> list[str]:
    return [r.request_id for r in records]


def test_known_step_quarantines_its_requests_and_leaves_the_others_alone() -> None:
    a, b, c = rec("a"), rec("b"), rec("c", suspect_streak=1)
    plan = triage([(a, 0), (b, 0), (c, 0)], ["a", "b"])
    assert not plan.give_up
    by_id = {r.request_id: r for r in plan.resend}
    assert by_id["a"].quarantined and by_id["b"].quarantined and not by_id["c"].quarantined
    assert by_id["a"].suspect_streak == 1 and by_id["a"].solo_crashes == 0
    assert by_id["c"].suspect_streak == 0  # not in the failing step: its streak ends


def test_quarantined_suspect_is_given_up_after_its_second_solo_crash() -> None:
    r = rec("r", quarantined=True)
    first = triage([(r, 0)], ["r"])
    assert ids(first.resend) == ["r"] and first.resend[0].solo_crashes == 1
    second = triage([(first.resend[0], 0)], ["r"])
    assert not second.resend and ids(second.give_up) == ["r"]


def test_progress_clears_past_crashes() -> None:
    r = rec("r", quarantined=True, solo_crashes=1, suspect_streak=3, progress_mark=4)
    plan = triage([(r, 5)], ["r"])  # one token since it was sent: a clean start, then this crash
    (new,) = plan.resend
    assert (new.solo_crashes, new.suspect_streak, new.quarantined) == (0, 1, True)
    assert new.progress_mark == 5


def test_unknown_step_blames_started_requests_without_progress_only() -> None:
    ran, queued, streaming = rec("ran", started=True), rec("queued", suspect_streak=1), rec("streaming", started=True)
    plan = triage([(ran, 0), (queued, 0), (streaming, 3)], None)
    assert not plan.give_up
    by_id = {r.request_id: r for r in plan.resend}
    assert by_id["ran"].suspect_streak == 1
    assert by_id["queued"].suspect_streak == 1  # never ran: neither blamed nor cleared
    assert by_id["streaming"].suspect_streak == 0
    assert not any(r.quarantined for r in plan.resend)
    again = dataclasses.replace(by_id["ran"], started=True)
    plan = triage([(again, 0)], None)  # a suspect of two crashes in a row
    assert ids(plan.give_up) == ["ran"]


def test_struck_requests_are_resent_first_otherwise_order_is_kept() -> None:
    a, b, c = rec("a"), rec("b", quarantined=True), rec("c")
    plan = triage([(a, 0), (b, 0), (c, 0)], ["b"])
    assert ids(plan.resend) == ["b", "a", "c"]
    plan = triage([(a, 0), (c, 0)], [])
    assert ids(plan.resend) == ["a", "c"]


def test_triage_is_pure() -> None:
    r = rec("r", started=True, quarantined=True)
    before = dataclasses.replace(r)
    plan = triage([(r, 2)], ["r"])
    assert r == before  # the input record is unchanged
    assert plan.resend[0] is not r and not plan.resend[0].started  # a resent request starts over


def test_resubmission_and_give_up_output() -> None:
    r = rec("r", quarantined=True, num_prompt_lp_rows=2)
    req = r.resubmission([5, 6])
    assert (req.request_id, req.resumed_output_token_ids, req.num_prompt_logprobs_sent, req.quarantined) == (
        "r", [5, 6], 2, True)
    assert r.request.resumed_output_token_ids != [5, 6]  # the first request is kept as it was
    out = give_up_output(r)
    assert out.request_id == "r" and out.finish_reason == FinishReason.ERROR and out.error == GIVE_UP_ERROR
