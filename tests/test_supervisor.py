"""The engine-core supervisor's state machine (frontend/supervisor.py) on a fake connection:
live -> lost -> reconnecting -> live, every way to dead, and the moves it refuses."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tidal.frontend.supervisor import CoreState, CoreSupervisor, IllegalTransition
from tidal.protocol.config import EngineConfig
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutput

LIVE, LOST, RECONNECTING, DEAD = CoreState.LIVE, CoreState.LOST, CoreState.RECONNECTING, CoreState.DEAD


class FakeLink:
    """A connection whose replacements fail `failures` times first (with `error`)."""

    def __init__(self, failures: int = 0, error: BaseException | None = None) -> None:
        self.failures, self.error = failures, error
        self.calls: list[str] = []

    def before_replace(self) -> None:
        self.calls.append("before")

    def replace_core(self) -> object:
        self.calls.append("replace")
        if self.failures:
            self.failures -= 1
            raise self.error or RuntimeError("injected: start failed")
        return object()

    def after_replace(self) -> None:
        self.calls.append("after")


def make(link: FakeLink | None = None, attach: bool = True, **cfg: Any) -> tuple[CoreSupervisor, dict[str, list[Any]]]:
    seen: dict[str, list[Any]] = {"resume": [], "lost": [], "dead": []}
    sup = CoreSupervisor(EngineConfig(model="", **cfg), link or FakeLink())

    def resume(failed: list[str] | None) -> list[EngineCoreOutput]:
        seen["resume"].append(failed)
        return [EngineCoreOutput("given-up")]

    if attach:
        sup.attach(resume, on_lost=seen["lost"].append, on_dead=seen["dead"].append)
    return sup, seen


def test_lost_then_recovered_resumes_with_the_failing_step() -> None:
    link = FakeLink()
    sup, seen = make(link)
    assert sup.state is LIVE and sup.live
    sup.core_gone("the engine-core process exited unexpectedly")  # the watcher, first
    assert sup.state is LOST and seen["lost"] == ["the engine-core process exited unexpectedly"]
    sup.core_gone("its engine_dead", failed_step_request_ids=["a"])  # the core's last word counts
    sup.core_gone("again")  # idempotent
    assert sup.failed_step_request_ids == ["a"] and len(seen["lost"]) == 1
    give_up = sup.recover()
    assert sup.state is LIVE and sup.num_restarts == 1
    assert [o.request_id for o in give_up] == ["given-up"] and seen["resume"] == [["a"]]
    assert link.calls == ["before", "replace", "after"]


def test_recover_async_runs_the_replacement_off_the_loop() -> None:
    sup, seen = make()
    sup.core_gone("lost the connection to the engine core")
    asyncio.run(sup.recover_async())
    assert sup.state is LIVE and seen["resume"] == [None]


def test_no_restart_left_or_not_restartable_or_unattached_is_dead() -> None:
    sup, seen = make(max_core_restarts=1)
    sup.core_gone("one")
    sup.recover()
    sup.core_gone("two")  # the one restart of the window is spent
    assert sup.state is DEAD and isinstance(sup.error, EngineDeadError) and "two" in str(sup.error)
    assert seen["dead"] == [sup.error]
    with pytest.raises(EngineDeadError):
        sup.check()
    other, _ = make()
    other.core_gone("the front-end output handler failed", restartable=False)
    assert other.state is DEAD
    unattached, _ = make(attach=False)
    unattached.core_gone("during start-up")
    assert unattached.state is DEAD
    off, _ = make(max_core_restarts=0)
    off.core_gone("x")
    assert off.state is DEAD
    stopping, _ = make()
    stopping.shutting_down = True
    stopping.core_gone("part of the shutdown")
    assert stopping.state is DEAD


def test_a_spawned_replacement_that_dies_while_starting_is_retried_then_dead() -> None:
    sup, _ = make(FakeLink(failures=1))
    sup.core_gone("x")
    sup.recover()
    assert sup.state is LIVE and sup.num_restarts == 2
    sup, seen = make(FakeLink(failures=5), max_core_restarts=2)
    sup.core_gone("x")
    with pytest.raises(EngineDeadError, match="x; restarting it failed: .*injected: start failed"):
        sup.recover()
    assert sup.state is DEAD and sup.num_restarts == 2 and seen["dead"]


def test_a_headless_core_gets_one_attempt() -> None:
    sup, _ = make(FakeLink(failures=1), core_address="tcp://127.0.0.1:1")
    sup.core_gone("x")
    with pytest.raises(EngineDeadError, match="restarting it failed"):
        sup.recover()
    assert sup.num_restarts == 1


def test_a_failed_resume_is_dead_naming_the_cause() -> None:
    sup = CoreSupervisor(EngineConfig(model=""), FakeLink())

    def broken(failed: list[str] | None) -> list[EngineCoreOutput]:
        raise RuntimeError("injected: resubmission failed")

    dead: list[EngineDeadError] = []
    sup.attach(broken, on_dead=dead.append)
    sup.core_gone("x")
    with pytest.raises(EngineDeadError, match="injected: resubmission failed"):
        sup.recover()
    assert sup.state is DEAD and dead == [sup.error]


def test_shutdown_is_dead_from_any_state_and_not_a_crash() -> None:
    for lose in (False, True):
        sup, seen = make()
        if lose:
            sup.core_gone("x")
        sup.shutdown()
        assert sup.state is DEAD and sup.dead_by_shutdown and "shut down" in str(sup.error)
        assert seen["dead"] == [sup.error]
        with pytest.raises(EngineDeadError, match="shut down"):
            sup.recover()  # a recovery that comes after the shutdown gives up
    crashed, _ = make(max_core_restarts=0)
    crashed.core_gone("crash")
    crashed.shutdown()
    assert not crashed.dead_by_shutdown and "crash" in str(crashed.error)


def test_a_death_while_reconnecting_counts_once_live() -> None:
    sup, seen = make()

    class DyingLink(FakeLink):
        def after_replace(self) -> None:  # the new core's watcher fires before it is live
            sup.core_gone("the new core went too")
            assert sup.state is RECONNECTING

    sup._link = DyingLink()
    sup.core_gone("x")
    sup.recover()
    assert sup.state is LOST and seen["lost"] == ["x", "the new core went too"]


def test_illegal_transitions_raise() -> None:
    sup, _ = make()
    with pytest.raises(IllegalTransition, match="live -> reconnecting"):
        sup.recover()  # nothing was lost
    assert sup.state is LIVE
    sup.core_gone("x")
    sup.state = RECONNECTING  # as if a recovery were in flight
    with pytest.raises(IllegalTransition, match="reconnecting -> reconnecting"):
        sup.recover()  # a second recovery at once
    sup.state = LOST
    sup.fail("given up")
    with pytest.raises(IllegalTransition, match="dead -> live"):
        with sup._lock:
            sup._to(LIVE)  # DEAD is terminal
    sup.core_gone("late report")  # ignored, not an error
    assert sup.state is DEAD and "given up" in str(sup.error)
