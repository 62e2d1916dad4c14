"""What the front-end keeps of each request to resume it on a new engine core, and the pure
triage that decides, after a crash, which requests to resend and which to give up.

`ResumeRecord` is the one per-request record (`RequestState.resume`); `triage` reads records
and returns new ones, never changing what it is given, so the blame rule is tested without a
core, a socket or an OutputProcessor (tests/test_recovery_triage.py). The supervisor
(frontend/supervisor.py) runs it through `OutputProcessor.resume_after_crash`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable
from typing import NamedTuple

import msgspec

from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, FinishReason

GIVE_UP_ERROR = "request was in flight during repeated engine failures"


@dataclasses.dataclass(slots=True)
class ResumeRecord:
    """One request's resumption state. Invariants: `progress_mark <= len(generated)` of its
    request; `solo_crashes > 0` or `suspect_streak > 0` only while it made no progress since
    the crash that counted them; `started` is reset whenever it is (re)sent."""

    request: EngineCoreRequest  # as first sent (a resubmission adds the tokens so far)
    progress_mark: int = 0  # tokens generated when it was last sent
    suspect_streak: int = 0  # crashes in a row it was a suspect of, without progress
    solo_crashes: int = 0  # crashes while it ran alone (quarantined), without progress
    quarantined: bool = False  # it goes back quarantined: alone in its steps until a token
    # The current core started it: any output of it came (the core announces each request as
    # its first step begins). Set per output on the hot path, so a plain attribute.
    started: bool = False
    num_prompt_lp_rows: int = 0  # prompt-logprob rows received (not sent again)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def resubmission(self, generated: list[int]) -> EngineCoreRequest:
        """The request to send a new core: it resumes after `generated`."""
        return msgspec.structs.replace(self.request, resumed_output_token_ids=list(generated),
                                       num_prompt_logprobs_sent=self.num_prompt_lp_rows,
                                       quarantined=self.quarantined)


class Triage(NamedTuple):
    resend: list[ResumeRecord]  # new records, in the order to send them (struck ones first)
    give_up: list[ResumeRecord]  # the records of the requests given up, unchanged


def triage(requests: Iterable[tuple[ResumeRecord, int]],
           failed_step_request_ids: Collection[str] | None) -> Triage:
    """Blame after a crash. `requests`: each open request's record and how many tokens it has
    generated so far; `failed_step_request_ids`: this front-end's requests in the step that
    failed (from the dying core's engine_dead), None when unknown (the process vanished).

    - A request that made progress (a new token) since it was last sent starts clean.
    - Known step: its requests are the suspects; each goes back `quarantined` (the core runs it
      alone until its next token). The others were not in the step: nothing changes for them,
      however many crashes they wait through. A suspect that was quarantined ran alone, so the
      crash was its own: after its second such crash without progress it is given up (one can
      be a coincidence, a fault from outside during its step). A request that crashes the
      engine whenever it runs thus fails after three crashes.
    - Unknown step: the requests the lost core started that made no progress are suspects; a
      suspect of two crashes in a row is given up. A request still queued at the crash never
      ran: it is neither blamed nor cleared (its streak stands).
    Struck requests (a crash while alone) are resent first, so that they run first."""
    failed = None if failed_step_request_ids is None else set(failed_step_request_ids)
    resend: list[ResumeRecord] = []
    give_up: list[ResumeRecord] = []
    for record, num_generated in requests:
        streak, solo, quarantined = record.suspect_streak, record.solo_crashes, record.quarantined
        if num_generated > record.progress_mark:  # progress: cleared of past crashes
            streak, solo, quarantined = 0, 0, False
        if failed is None:
            if record.started and num_generated == record.progress_mark:
                streak += 1
            guilty = streak >= 2
        elif record.request_id in failed:
            streak += 1
            if quarantined:  # it ran alone (and made no progress): the crash was its own
                solo += 1
            quarantined = True
            guilty = solo >= 2
        else:
            streak, guilty = 0, False
        if guilty:
            give_up.append(record)
            continue
        resend.append(dataclasses.replace(record, progress_mark=num_generated, suspect_streak=streak,
                                          solo_crashes=solo, quarantined=quarantined, started=False))
    resend.sort(key=lambda r: not r.solo_crashes)  # stable: struck first, else arrival order
    return Triage(resend, give_up)


def give_up_output(record: ResumeRecord) -> EngineCoreOutput:
    """The ERROR output that ends a request given up, processed as any core output."""
    return EngineCoreOutput(record.request_id, finish_reason=FinishReason.ERROR, error=GIVE_UP_ERROR)
