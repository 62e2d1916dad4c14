"""Grammar compiles are bounded (core/grammar_compile.py): a compile past
grammar_compile_timeout_s fails its request alone while a simple constrained request beside it
finishes; aborting a compiling request ends it at once and kills the process compiling for it;
a compile process that dies fails its request alone; requests waiting for their grammar do not
count toward max_waiting_requests; shutdown leaves no compile process behind.

The slow case is a JSON schema of arrays nested 800 deep: xgrammar compiles it for ~25 s on a
2-core box (its time grows about with the cube of the depth), far past this module's 3 s limit,
while the simple schema compiles in milliseconds. The tests assert outcomes, never durations;
every wait has a generous deadline as a hang guard.
"""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import jsonschema
import psutil
import pytest

from tests.engine_utils import make_core, req, step_outputs
from tidal.core.engine_core import EngineCore
from tidal.core.request import RequestStatus
from tidal.protocol import SamplingParams, StructuredOutputsParams
from tidal.protocol.messages import EngineCoreOutput, ErrorKind, FinishReason

LIMIT_S = 3.0
HANG_GUARD_S = 120.0
SIMPLE: dict[str, Any] = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                          "required": ["ok", "n"]}
PROMPT = [5, 6, 7]


def nested_arrays(depth: int) -> str:
    """A JSON schema of arrays nested `depth` deep (as text: json.dumps would recurse too deep)."""
    return '{"type": "array", "items": ' * depth + '{"type": "integer"}' + "}" * depth


def _sp(seed: int = 1, max_tokens: int = 60, **constraint: Any) -> SamplingParams:
    so = StructuredOutputsParams(**constraint) if constraint else None
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=so)


@pytest.fixture(scope="module")
def core(tiny_model_dir: str) -> Iterator[EngineCore]:
    engine = make_core(tiny_model_dir, max_model_len=256, grammar_compile_timeout_s=LIMIT_S, max_waiting_requests=1)
    try:
        # Warm: the first constrained request starts the compile processes; with both ready,
        # the tests' outcomes do not depend on how fast a process starts.
        run = Run(engine)
        engine.add_request(req("warm", PROMPT, _sp(regex="[a-z]{1,3}")))
        run.finish("warm")
        pool = engine.structured_output_manager._pool
        deadline = time.monotonic() + HANG_GUARD_S
        while pool is None or pool.num_ready() < 2:
            assert time.monotonic() < deadline, "the compile processes did not start"
            time.sleep(0.05)
        yield engine
    finally:
        engine.shutdown()


class Run:
    """Drives an in-process core, keeping every output by request id and the finish order."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.outs: dict[str, list[EngineCoreOutput]] = {}
        self.order: list[str] = []

    def step(self) -> list[EngineCoreOutput]:
        outs = step_outputs(self.core)
        for out in outs:
            self.outs.setdefault(out.request_id, []).append(out)
            if out.finish_reason is not None:
                self.order.append(out.request_id)
        return outs

    def until(self, done: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + HANG_GUARD_S  # a hang guard, not a timing assertion
        while not done():
            assert time.monotonic() < deadline, f"{what}: not within {HANG_GUARD_S} s: {self.outs}"
            self.step()

    def finish(self, *rids: str) -> None:
        self.until(lambda: all(r in self.order for r in rids), f"{rids} finished")

    def last(self, rid: str) -> EngineCoreOutput:
        return self.outs[rid][-1]

    def running_pid(self, rid: str) -> int:
        """Step until `rid`'s compile runs in a child process; that child's pid."""
        som = self.core.structured_output_manager
        job = som._pending[rid].structured_output_request.job  # type: ignore[union-attr]
        pid: list[int | None] = [None]

        def started() -> bool:
            pid[0] = som._pool.running_pid(job) if som._pool is not None else None
            return pid[0] is not None

        self.until(started, f"{rid}'s compile started")
        assert pid[0] is not None
        return pid[0]

    def text(self, rid: str) -> str:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(self.core.config.model)
        return tokenizer.decode([t for o in self.outs[rid] for t in o.new_token_ids], skip_special_tokens=True)


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + 10.0
    while psutil.pid_exists(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not psutil.pid_exists(pid)


def test_slow_compile_times_out_alone_while_a_simple_one_finishes(core: EngineCore) -> None:
    run = Run(core)
    core.add_request(req("slow", PROMPT, _sp(json=nested_arrays(800))))
    core.add_request(req("simple", PROMPT, _sp(json=SIMPLE, disable_any_whitespace=True)))
    core.add_request(req("free", PROMPT, _sp(max_tokens=5)))
    pid = run.running_pid("slow")
    run.finish("slow", "simple", "free")
    slow = run.last("slow")
    assert slow.finish_reason == FinishReason.ERROR and slow.error_kind == ErrorKind.INVALID
    assert f"longer than the engine's limit of {LIMIT_S:g} s (grammar_compile_timeout_s)" in (slow.error or "")
    assert not any(o.new_token_ids for o in run.outs["slow"])
    assert run.last("simple").finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(run.text("simple")), SIMPLE)
    assert run.last("free").finish_reason == FinishReason.LENGTH
    assert run.order.index("simple") < run.order.index("slow")  # it did not wait for the slow compile
    assert wait_gone(pid)  # the compile was stopped, not left burning a core
    # The engine serves on: the slot that was stopped compiles the next grammars.
    for i in range(3):
        core.add_request(req(f"after{i}", PROMPT, _sp(seed=i, json=SIMPLE, max_whitespace_cnt=1 + i)))
    run.finish("after0", "after1", "after2")
    for i in range(3):
        assert run.last(f"after{i}").finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(run.text(f"after{i}")), SIMPLE)


def test_abort_ends_a_compiling_request_at_once_and_stops_its_compile(core: EngineCore) -> None:
    run, som = Run(core), core.structured_output_manager
    core.add_request(req("a", PROMPT, _sp(json=nested_arrays(801))))
    pid = run.running_pid("a")
    core.abort_requests(["a"])
    assert [(o.request_id, o.finish_reason) for o in run.step()] == [("a", FinishReason.ABORT)]  # at once
    assert "a" not in core.scheduler.requests and som.num_waiting_for_grammar() == 0
    assert wait_gone(pid)
    # Two slots: two compiles run, a third waits in the queue; aborted, none of them goes on.
    for i in range(3):
        core.add_request(req(f"b{i}", PROMPT, _sp(json=nested_arrays(802 + i))))
    pids = [run.running_pid("b0"), run.running_pid("b1")]
    queued = som._pending["b2"].structured_output_request.job  # type: ignore[union-attr]
    assert not queued.future.running() and not queued.future.done()
    core.abort_requests(["b0", "b1", "b2"])
    assert {(o.request_id, o.finish_reason) for o in run.step()} == {(f"b{i}", FinishReason.ABORT) for i in range(3)}
    assert all(wait_gone(p) for p in pids) and queued.future.cancelled()
    core.add_request(req("next", PROMPT, _sp(regex="[a-z]{2,5}")))
    run.finish("next")
    assert run.last("next").finish_reason == FinishReason.STOP


def test_a_compile_process_that_dies_fails_its_request_alone(core: EngineCore) -> None:
    run = Run(core)
    core.add_request(req("dies", PROMPT, _sp(json=nested_arrays(806))))
    core.add_request(req("ok", PROMPT, _sp(seed=4, json=SIMPLE, max_whitespace_cnt=5)))
    os.kill(run.running_pid("dies"), signal.SIGKILL)  # fault injection: a crash, the OOM killer
    run.finish("dies", "ok")
    dies = run.last("dies")
    assert dies.finish_reason == FinishReason.ERROR and dies.error_kind == ErrorKind.REQUEST  # not the spec's fault
    assert "the grammar compiler process died" in (dies.error or ""), dies.error
    assert run.last("ok").finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(run.text("ok")), SIMPLE)


def test_requests_waiting_for_a_grammar_do_not_count_as_waiting(core: EngineCore) -> None:
    """max_waiting_requests=1: any number of requests may wait for their grammar; plain
    requests still find the limit."""
    run = Run(core)
    for i in range(4):
        core.add_request(req(f"g{i}", PROMPT, _sp(json=nested_arrays(805))))  # one shared compile
    core.add_request(req("plain0", PROMPT, _sp(max_tokens=3)))
    core.add_request(req("plain1", PROMPT, _sp(max_tokens=3)))  # plain0 waits: over the limit
    refused = [o for o in run.step() if o.error_kind == ErrorKind.OVERLOADED]
    assert [o.request_id for o in refused] == ["plain1"], run.outs
    assert "max_waiting_requests=1" in (refused[0].error or "")
    assert all(core.scheduler.requests[f"g{i}"].status == RequestStatus.WAITING_FOR_GRAMMAR for i in range(4))
    core.abort_requests([f"g{i}" for i in range(4)])
    run.finish("plain0", "g0", "g1", "g2", "g3")
    assert run.last("plain0").finish_reason == FinishReason.LENGTH and not core.scheduler.requests


def test_shutdown_stops_every_compile_process(tiny_model_dir: str) -> None:
    engine = make_core(tiny_model_dir, max_model_len=256)
    run = Run(engine)
    engine.add_request(req("s", PROMPT, _sp(json=nested_arrays(807))))
    pids = {run.running_pid("s")}
    pool = engine.structured_output_manager._pool
    assert pool is not None
    pids |= {slot.proc.pid for slot in pool._slots if slot.proc is not None}  # the idle one too
    engine.shutdown()
    assert all(wait_gone(pid) for pid in pids), pids
