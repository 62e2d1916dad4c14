"""Quarantine: requests suspected of crashing the engine run each in a step of its own.

After a crash the front-end resubmits the requests that were in the step that failed as
`quarantined` (frontend/recovery.py triage): one of them may have caused it, the others
only shared its step. The scheduler runs a quarantined request alone -- no other request in
its steps -- until it produces a token (its first progress), then lifts the quarantine and it
runs as any other. A crash while it runs alone is then its own, and sharing a step with a
culprit never makes an innocent request look guilty.

Invariants:
- Without quarantined requests the scheduler's normal path runs unchanged (`Scheduler.schedule`
  calls in here only while `Quarantine` is non-empty): no work per step in normal operation.
- A quarantined request is never in a step with another request. Steps alternate between a solo
  step (the first quarantined request: one already running, i.e. mid-prefill, else the first
  one admitted) and a step of the other requests, so both make progress; a turn with nothing to
  run passes to the other kind within the same step. The first step of a core with quarantined
  requests is a solo step (the front-end sends the strongest suspects first).
- Quarantine only chooses what the scheduler plans a step from (`Scheduler.plan_step`'s
  explicit inputs) and never touches its lists: in a step of the others, quarantined requests
  are left out of the running and waiting requests passed (their seats still count against
  max_num_seqs, and they are not preemption victims); a solo step passes the one request.
- The quarantine of a request lifts once its output grew past what it had when it was queued
  (checked at the next schedule), or when it ends.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tidal.core.request import Request, RequestStatus
from tidal.core.request_queue import RequestQueue, create_request_queue

if TYPE_CHECKING:
    from tidal.core.scheduler import Scheduler
    from tidal.core.step_plan import StepPlan


class Quarantine:
    def __init__(self) -> None:
        # request id -> (request, its output tokens when queued), in arrival order
        self.requests: dict[str, tuple[Request, int]] = {}
        self.solo_turn = True  # the next step runs a quarantined request alone

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = (request, request.num_output_tokens)

    def discard(self, request: Request) -> None:
        """A quarantined request ended (finished, aborted, failed)."""
        self.requests.pop(request.request_id, None)
        request.quarantined = False

    def _lift_progressed(self) -> None:
        for rid, (request, mark) in list(self.requests.items()):
            if request.num_output_tokens > mark:
                del self.requests[rid]
                request.quarantined = False

    def schedule(self, sched: "Scheduler", plan: "StepPlan") -> None:
        """Plan one step (Scheduler.schedule, while any request is quarantined)."""
        self._lift_progressed()
        if not self.requests:
            sched.plan_step(plan, sched.running, sched.waiting)
            return
        for solo in ((True, False) if self.solo_turn else (False, True)):
            if solo:
                self._solo_step(sched, plan)
            else:
                self._others_step(sched, plan)
            if plan.num_scheduled_tokens or plan.preempted:
                self.solo_turn = not solo
                return

    def _pick(self, sched: "Scheduler") -> Request | None:
        """The quarantined request to run alone: one already running (mid-prefill) first, else
        the first queued one whose grammar is ready."""
        candidate = None
        for request, _ in self.requests.values():
            if request.status == RequestStatus.RUNNING:
                return request
            if candidate is None and request.status != RequestStatus.WAITING_FOR_GRAMMAR:
                candidate = request
        return candidate

    def _solo_step(self, sched: "Scheduler", plan: "StepPlan") -> None:
        request = self._pick(sched)
        if request is None:
            return
        if request.status == RequestStatus.RUNNING:  # it alone (it may preempt only itself)
            sched.plan_step(plan, [request], _queue(sched))
        else:  # admits it alone, if blocks and seats allow
            sched.plan_step(plan, [], _queue(sched, [request]))

    def _others_step(self, sched: "Scheduler", plan: "StepPlan") -> None:
        running = [r for r in sched.running if not r.quarantined]
        if len(running) == len(sched.running):
            running = sched.running  # nothing held out: the scheduler's own list
        held = {id(r) for r, _ in self.requests.values() if r.status != RequestStatus.RUNNING}
        waiting = _queue(sched, [r for r in sched.waiting if id(r) not in held]) if held else sched.waiting
        sched.plan_step(plan, running, waiting)


def _queue(sched: "Scheduler", requests: list[Request] | None = None) -> RequestQueue:
    """A queue of some of the scheduler's waiting requests (in its order), for `plan_step`."""
    queue = create_request_queue(sched.policy)
    for request in requests or ():
        queue.add_request(request)
    return queue
