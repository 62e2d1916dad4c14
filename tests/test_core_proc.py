"""The engine-core process: headless core over TCP with front-ends coming and going, garbage
on its socket, requests it rejects, start-up failure, clean SIGTERM."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Iterator

import msgspec
import psutil
import pytest
import zmq

from tidal.frontend import AsyncLLM
from tidal.protocol import EngineGenerateError, RequestOutputKind, SamplingParams
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequestType, UtilityRequest

try:
    from conftest import core_children, free_tcp_port, ipc_dir_of
except ImportError:  # tests/ made a package
    from tests.conftest import core_children, free_tcp_port, ipc_dir_of  # type: ignore[no-redef]

ADD, ABORT, UTILITY = (t.value for t in EngineCoreRequestType)


async def generate_all(engine: AsyncLLM, rid: str, max_tokens: int) -> list[int]:
    ids: list[int] = []
    async for out in engine.generate("abc", SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA), rid):
        ids += out.outputs[0].token_ids
    return ids


async def wait_until_idle(engine: AsyncLLM, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await engine.get_stats()
        if stats.num_running_reqs + stats.num_waiting_reqs == 0 or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.05)


@pytest.fixture(scope="module")
def headless_core(long_model_dir: str) -> Iterator[tuple[str, subprocess.Popen]]:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = subprocess.Popen([
        sys.executable, "-m", "tidal.frontend.entrypoints.cli", "core", long_model_dir, "--address", address,
        "--model-runner", "null", "--max-model-len", "65536", "--max-num-seqs", "16",
    ])
    try:
        yield address, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


_FRONT_END = textwrap.dedent("""
    import asyncio, sys
    from tidal.frontend import AsyncLLM
    from tidal.protocol import SamplingParams

    async def main():
        engine = AsyncLLM(model=sys.argv[1], core_address=sys.argv[2], engine_start_timeout_s=60)
        seen = set()
        async def run(i):
            async for _ in engine.generate("abc", SamplingParams(max_tokens=60000, ignore_eos=True), f"fe1-{i}"):
                seen.add(i)
                if len(seen) == 4:
                    print("STREAMING", flush=True)
        await asyncio.gather(*(run(i) for i in range(4)))

    asyncio.run(main())
""")


async def test_headless_core_front_ends_come_and_go(headless_core: tuple[str, subprocess.Popen],
                                                    long_model_dir: str) -> None:
    address, core = headless_core
    # Front-end 1: another process, killed while its 4 requests stream; it cannot say goodbye.
    fe1 = subprocess.Popen([sys.executable, "-c", _FRONT_END, long_model_dir, address],
                           stdout=subprocess.PIPE, text=True)
    try:
        assert fe1.stdout is not None and fe1.stdout.readline().strip() == "STREAMING"
    finally:
        fe1.kill()
        fe1.wait()
    # Front-end 2 connects afterwards and is served; the core dropped front-end 1's requests.
    engine = AsyncLLM(model=long_model_dir, core_address=address, engine_start_timeout_s=60)
    try:
        assert engine.engine_core.process is None  # connected, not spawned
        assert engine.info.max_model_len == 65536
        assert len(await generate_all(engine, "fe2", 50)) == 50
        stats = await wait_until_idle(engine)
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        assert stats.num_free_blocks == stats.num_total_blocks
    finally:
        engine.shutdown()
    # Front-end 3: leaves politely while a request runs (shutdown aborts it in the core).
    engine = AsyncLLM(model=long_model_dir, core_address=address, engine_start_timeout_s=60)
    try:
        gen = engine.generate("abc", SamplingParams(max_tokens=60000, ignore_eos=True), "fe3")
        await gen.__anext__()
    finally:
        engine.shutdown()
    engine = AsyncLLM(model=long_model_dir, core_address=address, engine_start_timeout_s=60)
    try:
        stats = await wait_until_idle(engine)
        assert stats.num_running_reqs == 0
        assert len(await generate_all(engine, "fe3", 20)) == 20
    finally:
        engine.shutdown()
    assert core.poll() is None, "the headless core must outlive its front-ends"


def test_headless_core_rejects_wildcard_address(long_model_dir: str) -> None:
    res = subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "core", long_model_dir,
                          "--address", "tcp://0.0.0.0:5999", "--model-runner", "null"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "wildcard" in res.stderr


async def test_garbage_is_dropped_and_core_keeps_serving(headless_core: tuple[str, subprocess.Popen],
                                                         long_model_dir: str) -> None:
    address, core = headless_core
    ctx = zmq.Context()
    try:
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(address)
        enc = MsgpackEncoder()
        ok_add = msgspec.msgpack.encode(["bad-params", [1, 2], [1, 0, 0, 0, -5.0]])  # temperature -5
        for frames in ([b"\x09", b"junk"], [ADD, b"\xc1not msgpack"], [ADD], [b""], [UTILITY, b"\x93"],
                       [ABORT, msgspec.msgpack.encode({"not": "a list"})], [ADD, ok_add],
                       [UTILITY, *enc.encode(UtilityRequest(5, "no_such_method"))]):
            raw.send_multipart(frames)
        # Raw bytes on the TCP port, not even ZMTP.
        host, port = address[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as s:
            s.sendall(os.urandom(4096))
        dec = MsgpackDecoder(EngineCoreOutputs)
        replies: list[EngineCoreOutputs] = []
        while len(replies) < 2 and raw.poll(5000):
            replies.append(dec.decode(raw.recv_multipart()))
        errors = [o for r in replies for o in r.outputs]
        # The ADD whose id was readable got an ERROR for that request; the unknown utility a failure.
        assert [(o.request_id, o.finish_reason.name) for o in errors] == [("bad-params", "ERROR")]
        failures = [r.utility_output for r in replies if r.utility_output is not None]
        assert failures and failures[0].call_id == 5 and "no_such_method" in failures[0].failure
    finally:
        ctx.destroy(linger=0)
    assert core.poll() is None
    engine = AsyncLLM(model=long_model_dir, core_address=address, engine_start_timeout_s=60)
    try:
        assert len(await generate_all(engine, "after-garbage", 30)) == 30
    finally:
        engine.shutdown()


async def test_request_rejected_by_core_fails_alone(long_model_dir: str, no_leaked_cores: None) -> None:
    async with AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=4096) as engine:
        # Let a bad token id past the front-end's own check so that the core rejects it.
        ip = engine.input_processor
        ip.limits = dataclasses.replace(ip.limits, vocab_size=10**6)
        good = [asyncio.create_task(generate_all(engine, f"good-{i}", 200)) for i in range(4)]
        with pytest.raises(EngineGenerateError, match=r"out of vocabulary range \[0, 512\)"):
            async for _ in engine.generate({"prompt_token_ids": [1, 2, 999_999]}, SamplingParams(), "bad"):
                pass
        assert [len(ids) for ids in await asyncio.gather(*good)] == [200] * 4
        assert not engine.errored
        assert len(await generate_all(engine, "bad", 5)) == 5  # the id is free again


def _broken_model(tmp: str, src: str, config_text: str | None) -> str:
    os.makedirs(tmp, exist_ok=True)
    for f in os.listdir(src):
        if f.startswith("tokenizer") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(src, f), tmp)
    if config_text is not None:
        with open(os.path.join(tmp, "config.json"), "w") as cfg:
            cfg.write(config_text)
    return tmp


@pytest.mark.parametrize("config_text, message", [(None, "no config.json"), ("{}", "vocab_size")])
def test_start_failure_reports_core_error(tmp_path: Any, tiny_model_dir: str, config_text: str | None,
                                          message: str, no_leaked_cores: None,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.frontend import core_process

    made: list[str] = []

    class RecordingIpcDir(core_process.IpcDir):
        def __init__(self) -> None:
            super().__init__()
            made.append(self.path)

    monkeypatch.setattr(core_process, "IpcDir", RecordingIpcDir)
    model = _broken_model(str(tmp_path / "broken"), tiny_model_dir, config_text)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=f"engine core failed to start: .*{message}"):
        AsyncLLM(model=model, model_runner="null", engine_start_timeout_s=60)
    assert time.monotonic() - t0 < 30
    assert not core_children()
    assert len(made) == 1 and not os.path.exists(made[0])


def test_start_timeout_when_nobody_answers(long_model_dir: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="no handshake"):
        AsyncLLM(model=long_model_dir, core_address=f"tcp://127.0.0.1:{free_tcp_port()}",
                 engine_start_timeout_s=1.0)
    assert time.monotonic() - t0 < 10


async def test_sigterm_is_a_clean_shutdown(long_model_dir: str) -> None:
    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=65536, max_num_seqs=4,
                      max_core_restarts=0)  # the core's own reason reaches the streams
    proc = engine.engine_core.process
    ipc_dir = ipc_dir_of(engine.engine_core.address)
    try:
        gen = engine.generate("abc", SamplingParams(max_tokens=60000, ignore_eos=True), "t")
        await gen.__anext__()
        proc.proc.send_signal(signal.SIGTERM)
        with pytest.raises(Exception, match="shut down"):  # EngineDeadError with the core's reason
            async for _ in gen:
                pass
        assert proc.proc.wait(10) == 0
    finally:
        engine.shutdown()
    assert not os.path.exists(ipc_dir)


_SPAWNING_FRONT_END = textwrap.dedent("""
    import sys, time
    from tidal.frontend import LLM
    llm = LLM(model=sys.argv[1], model_runner="null")
    print(llm.llm_engine.process.pid, llm.llm_engine.address, flush=True)
    time.sleep(600)
""")


def test_core_exits_when_its_front_end_is_killed(long_model_dir: str) -> None:
    fe = subprocess.Popen([sys.executable, "-c", _SPAWNING_FRONT_END, long_model_dir],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert fe.stdout is not None
        pid_text, address = fe.stdout.readline().split()
        core = psutil.Process(int(pid_text))
        fe.kill()
        fe.wait()
        core.wait(10)  # psutil.TimeoutExpired if it outlived its parent
        assert not os.path.exists(ipc_dir_of(address)), "the orphaned core removes the ipc dir"
    finally:
        if fe.poll() is None:
            fe.kill()


async def test_busy_loop_exception_reaches_every_stream(tmp_path: Any, long_model_dir: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception inside the core's loop: engine_dead with its text, non-zero exit code."""
    from tidal.core import engine_core
    from tidal.core.core_proc import EngineCoreProc
    from tidal.protocol import EngineConfig, EngineDeadError

    real_step = engine_core.EngineCore.step
    calls = [0]

    def failing_step(self: Any) -> Any:
        calls[0] += 1
        if calls[0] > 20:
            raise RuntimeError("boom in step")
        return real_step(self)

    monkeypatch.setattr(engine_core.EngineCore, "step", failing_step)
    address = f"ipc://{tmp_path}/core"
    proc = EngineCoreProc(EngineConfig(model=long_model_dir, model_runner="null", max_model_len=4096), address)
    exit_code: list[int] = []
    thread = threading.Thread(target=lambda: exit_code.append(proc.run()), daemon=True)
    thread.start()
    engine = AsyncLLM(model=long_model_dir, core_address=address, engine_start_timeout_s=30,
                      max_core_restarts=0)  # the core's own reason reaches the streams
    try:
        streams = [asyncio.create_task(generate_all(engine, f"x{i}", 3000)) for i in range(3)]
        for task in streams:
            with pytest.raises(EngineDeadError, match="boom in step"):
                await asyncio.wait_for(task, 10)
        with pytest.raises(EngineDeadError, match="boom in step"):
            await generate_all(engine, "later", 2)
    finally:
        engine.shutdown()
    thread.join(10)
    assert exit_code == [1]
