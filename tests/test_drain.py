"""Graceful drain of a headless core (issue 12, Build 6): SIGTERM to `tidal core` refuses new
requests ("engine core is shutting down"), lets the streams in flight finish with every token,
then tells the front-ends (engine_dead with the reason) and exits 0, leaving no process
behind; past --drain-timeout-s it stops anyway. (A spawned core does not drain: see
test_core_proc.py::test_sigterm_is_a_clean_shutdown.)"""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from typing import Iterator

import psutil
import pytest

from tidal.frontend import AsyncLLM
from tidal.protocol import EngineDeadError, EngineOverloadedError

try:
    from conftest import count_stream_tokens, free_tcp_port
    from test_wire_faults import reap
except ImportError:  # tests/ made a package
    from tests.conftest import count_stream_tokens, free_tcp_port  # type: ignore[no-redef]
    from tests.test_wire_faults import reap  # type: ignore[no-redef]

LONG = 60_000  # null-runner tokens: thousands of steps, so a stream is in flight at SIGTERM
EXIT_TIMEOUT_S = 120.0


def start_core(model: str, drain_timeout_s: float) -> tuple[str, subprocess.Popen]:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "core", model, "--address", address,
                             "--model-runner", "null", "--max-model-len", "65536", "--max-num-seqs", "16",
                             "--drain-timeout-s", str(drain_timeout_s)])
    return address, proc


@pytest.fixture
def core_proc(request: pytest.FixtureRequest, long_model_dir: str) -> Iterator[tuple[str, subprocess.Popen]]:
    address, proc = start_core(long_model_dir, request.param)
    try:
        yield address, proc
    finally:
        reap(proc)


def front_end(model: str, address: str) -> AsyncLLM:
    # No reconnect window: once the drained core is gone, streams fail at once.
    return AsyncLLM(model=model, core_address=address, engine_start_timeout_s=60, core_reconnect_timeout_s=0)


async def _start_streams(engine: AsyncLLM, count: int) -> list[asyncio.Future[int]]:
    events = [asyncio.Event() for _ in range(count)]
    tasks = [asyncio.ensure_future(count_stream_tokens(engine, f"s{i}", LONG, e)) for i, e in enumerate(events)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
    return tasks


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    try:
        return psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize("core_proc", [EXIT_TIMEOUT_S], indirect=True)
async def test_sigterm_drains_in_flight_streams_then_exits_0(core_proc: tuple[str, subprocess.Popen],
                                                             long_model_dir: str) -> None:
    address, proc = core_proc
    engine = front_end(long_model_dir, address)
    try:
        streams = await _start_streams(engine, 4)
        kids = _children(proc)
        proc.send_signal(signal.SIGTERM)
        # New requests are refused from the moment the core notices (within one step); the
        # few that may slip in before that are in flight like the others and complete.
        refused: EngineOverloadedError | None = None
        for i in range(1000):
            try:
                assert await asyncio.wait_for(count_stream_tokens(engine, f"late-{i}", 3), 60) == 3
            except EngineOverloadedError as e:
                refused = e
                break
        assert refused is not None and "engine core is shutting down" in str(refused)
        assert not any(t.done() for t in streams), "the streams must still be running at SIGTERM"
        # Every stream in flight finishes with all its tokens.
        assert await asyncio.wait_for(asyncio.gather(*streams), EXIT_TIMEOUT_S) == [LONG] * 4
        assert await asyncio.to_thread(proc.wait, EXIT_TIMEOUT_S) == 0
        # The front-end was told why (engine_dead), and later calls say so.
        with pytest.raises(EngineDeadError, match="drained"):
            await asyncio.wait_for(count_stream_tokens(engine, "after", 3), 60)
    finally:
        engine.shutdown()
    assert not [p for p in kids if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.parametrize("core_proc", [1.0], indirect=True)
async def test_drain_timeout_bounds_the_wait(core_proc: tuple[str, subprocess.Popen], long_model_dir: str) -> None:
    """Streams longer than the drain timeout: the core stops anyway, tells the front-end the
    reason (their streams raise EngineDeadError) and exits 0."""
    address, proc = core_proc
    engine = front_end(long_model_dir, address)
    try:
        (stream,) = await _start_streams(engine, 1)
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="drain timeout of 1s passed with 1 request"):
            await asyncio.wait_for(stream, EXIT_TIMEOUT_S)
        assert await asyncio.to_thread(proc.wait, EXIT_TIMEOUT_S) == 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("core_proc", [EXIT_TIMEOUT_S], indirect=True)
async def test_second_sigterm_stops_at_once(core_proc: tuple[str, subprocess.Popen], long_model_dir: str) -> None:
    address, proc = core_proc
    engine = front_end(long_model_dir, address)
    try:
        (stream,) = await _start_streams(engine, 1)
        proc.send_signal(signal.SIGTERM)
        # Wait until the core drains (it refuses new requests), then insist.
        for i in range(1000):
            try:
                await asyncio.wait_for(count_stream_tokens(engine, f"late-{i}", 3), 60)
            except EngineOverloadedError:
                break
        proc.send_signal(signal.SIGTERM)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(stream, EXIT_TIMEOUT_S)
        assert await asyncio.to_thread(proc.wait, EXIT_TIMEOUT_S) == 0
    finally:
        engine.shutdown()
