"""Faults on the wire between front-ends and the engine core (issue 12, "found by probing"):
frozen peers noticed by heartbeats, hostile messages (deep, oversized, mistyped, out-of-range
ids) dropped or failed alone, request ids per front-end, wildcard binds refused, and no
rejected or finished request kept alive."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import signal
import subprocess
import sys
import textwrap
import threading
import time
import tracemalloc
import weakref
from typing import Any, Iterator

import msgspec
import pytest
import zmq

from tidal.frontend import AsyncLLM
from tidal.frontend.core_client import SyncMPClient
from tidal.protocol import EngineConfig, EngineDeadError, RequestOutputKind, SamplingParams
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityRequest,
    decode_utility_result,
)
from tidal.utils.zmq_utils import MAX_MESSAGE_BYTES, validate_address

try:
    from conftest import free_tcp_port
except ImportError:  # tests/ made a package
    from tests.conftest import free_tcp_port  # type: ignore[no-redef]

ADD, ABORT, UTILITY = (t.value for t in EngineCoreRequestType)
HEARTBEAT_S = 2.0  # the heartbeat_timeout_s these tests configure
# "Within the configured bound": the timeout, the PING interval before it, and the time the
# watcher, the output handler and a loaded 2-core test machine take to report it.
BOUND_S = 3 * HEARTBEAT_S + 2


def core_config(model: str, **changes: Any) -> EngineConfig:
    settings: dict[str, Any] = dict(model_runner="null", max_model_len=65536, max_num_seqs=16,
                                    heartbeat_timeout_s=HEARTBEAT_S)
    return EngineConfig(model=model, **{**settings, **changes})


def start_headless_core(config: EngineConfig) -> tuple[str, subprocess.Popen]:
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "tidal.core.core_proc", "--address", address,
                             "--config-json", config.to_json().decode()])
    return address, proc


def reap(proc: subprocess.Popen) -> None:
    """Stop a process these tests started, frozen or not, and wait for it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.fixture(scope="module")
def core(long_model_dir: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """A headless core with a short heartbeat, shared by the tests that leave it running."""
    address, proc = start_headless_core(core_config(long_model_dir))
    try:
        yield address, proc
    finally:
        reap(proc)


def client_config(model: str, address: str) -> EngineConfig:
    return EngineConfig(model=model, core_address=address, engine_start_timeout_s=60,
                        heartbeat_timeout_s=HEARTBEAT_S)


async def generate_all(engine: AsyncLLM, rid: str, max_tokens: int, prompt: Any = "abc") -> list[int]:
    ids: list[int] = []
    async for out in engine.generate(prompt, SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA), rid):
        ids += out.outputs[0].token_ids
    return ids


class RawClient:
    """A DEALER that speaks the wire protocol by hand, as a hostile or broken client would."""

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(EngineCoreOutputs)
        self.received: list[EngineCoreOutputs] = []
        self._call_ids = itertools.count(1_000)

    def send(self, kind: bytes, obj: object) -> None:
        self.sock.send_multipart([kind, *self.encoder.encode(obj)])

    def outputs_until(self, done: Any, timeout_s: float = 30.0) -> list[EngineCoreOutputs]:
        """Every message received so far, once `done(messages)` holds (AssertionError after
        timeout_s)."""
        got = self.received
        deadline = time.monotonic() + timeout_s
        while not done(got):
            remaining_ms = int((deadline - time.monotonic()) * 1000)
            assert remaining_ms > 0 and self.sock.poll(remaining_ms), f"no answer; got {got}"
            got.append(self.decoder.decode(self.sock.recv_multipart()))
        return got

    def stats(self) -> Any:
        call_id = next(self._call_ids)
        self.send(UTILITY, UtilityRequest(call_id, "get_stats"))
        got = self.outputs_until(lambda m: any(o.utility_output and o.utility_output.call_id == call_id for o in m))
        u = next(o.utility_output for o in got if o.utility_output and o.utility_output.call_id == call_id)
        assert u.failure is None, u.failure
        return decode_utility_result("get_stats", u.result)


@contextlib.contextmanager
def raw_client(address: str) -> Iterator[RawClient]:
    ctx = zmq.Context()
    try:
        yield RawClient(ctx, address)
    finally:
        ctx.destroy(linger=0)


def finished(messages: list[EngineCoreOutputs]) -> dict[str, EngineCoreOutput]:
    return {o.request_id: o for m in messages for o in m.outputs if o.finished}


# ------------------------------------------------------------------ 1. a frozen core


@pytest.mark.parametrize("headless", [False, True], ids=["spawned", "headless"])
async def test_frozen_core_fails_streams_within_bound(long_model_dir: str, headless: bool,
                                                      no_leaked_cores: None) -> None:
    proc: subprocess.Popen | None = None
    if headless:
        address, proc = start_headless_core(core_config(long_model_dir, heartbeat_timeout_s=20.0))
        config = client_config(long_model_dir, address)
    else:
        config = core_config(long_model_dir)
    try:  # no restart: the bound is on noticing the frozen core (test_core_restart resumes)
        engine = AsyncLLM.from_config(config.replace(max_core_restarts=0))
        try:
            if proc is None:
                proc = engine.engine_core.process.proc
            streams = [asyncio.create_task(generate_all(engine, f"s{i}", 60000)) for i in range(4)]
            await asyncio.sleep(0.5)
            assert not any(t.done() for t in streams)
            proc.send_signal(signal.SIGSTOP)  # no exit, no FIN: only heartbeats can tell
            t0 = time.monotonic()
            for task in streams:
                with pytest.raises(EngineDeadError):
                    await asyncio.wait_for(task, BOUND_S)
            assert time.monotonic() - t0 < BOUND_S
        finally:
            engine.shutdown()
    finally:
        if proc is not None:
            reap(proc)


# ------------------------------------------------------------- 2. a frozen front-end

_FROZEN_FRONT_END = textwrap.dedent("""
    import asyncio, sys
    from tidal.frontend import AsyncLLM
    from tidal.protocol import EngineConfig, SamplingParams

    async def main():
        config = EngineConfig(model=sys.argv[1], core_address=sys.argv[2], engine_start_timeout_s=60,
                              heartbeat_timeout_s=float(sys.argv[3]))
        engine = AsyncLLM.from_config(config)
        seen = set()
        async def run(i):
            async for _ in engine.generate("abc", SamplingParams(max_tokens=60000, ignore_eos=True), f"frozen-{i}"):
                seen.add(i)
                if len(seen) == 16:
                    print("STREAMING", flush=True)
        await asyncio.gather(*(run(i) for i in range(16)))

    asyncio.run(main())
""")


def test_frozen_front_end_requests_and_blocks_are_freed(core: tuple[str, subprocess.Popen],
                                                        long_model_dir: str) -> None:
    address, core_proc = core
    fe = subprocess.Popen([sys.executable, "-c", _FROZEN_FRONT_END, long_model_dir, address, "60"],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert fe.stdout is not None and fe.stdout.readline().strip() == "STREAMING"
        fe.send_signal(signal.SIGSTOP)  # its host "froze": no FIN, no goodbye
        with raw_client(address) as other:
            assert other.stats().num_running_reqs == 16
            deadline = time.monotonic() + BOUND_S
            while True:
                stats = other.stats()
                if (stats.num_running_reqs + stats.num_waiting_reqs == 0
                        and stats.num_free_blocks == stats.num_total_blocks):
                    break
                assert time.monotonic() < deadline, f"still held after {BOUND_S}s: {stats}"
                time.sleep(0.2)
    finally:
        fe.kill()  # SIGKILL ends a stopped process too
        fe.wait(10)
    assert core_proc.poll() is None


# -------------------------------------------------------------- 3. hostile messages


def _deep(levels: int) -> bytes:
    return b"\x91" * levels + b"\x01"  # [[[...[1]...]]]


def _array(items: list[bytes]) -> bytes:
    assert len(items) < 16
    return bytes([0x90 + len(items)]) + b"".join(items)


async def test_deep_mistyped_and_oversized_messages_leave_the_core_serving(
        core: tuple[str, subprocess.Popen], long_model_dir: str) -> None:
    address, core_proc = core
    enc = msgspec.msgpack.encode
    params = enc(SamplingParams(max_tokens=3))
    with raw_client(address) as raw:
        frames: list[list[bytes]] = [
            # Utility arguments nested 100,000 deep: scalars only, refused at the second level.
            [UTILITY, _array([enc(7), enc("get_stats"), _deep(100_000)])],
            # The same depth where the decoder skips (trailing fields a newer peer may add).
            [UTILITY, _array([enc(8), enc("get_stats"), enc([]), _deep(100_000)])],
            [ADD, _array([enc("deep-add"), enc([1, 2, 3]), params, enc(None), enc(0.0), enc(0),
                          _deep(100_000)])],
            # Wrong types everywhere.
            [UTILITY, _array([enc("nine"), enc("get_stats")])],
            [UTILITY, _array([enc(10), enc("get_stats"), enc([{"a": 1}])])],
            [ADD, _array([enc("str-prompt"), enc(["a", "b"]), params])],
            [ABORT, enc([1, 2, 3])],
            [ADD, enc("not a request")],
            [ADD, _array([enc("extra-frame"), enc([1]), params]), b"extra"],
        ]
        for f in frames:
            raw.sock.send_multipart(f)
        got = raw.stats()  # answered after all of the above: the IO thread lives on
        assert got.num_running_reqs == 0
        # ADDs whose id was readable were answered with an ERROR; nothing else was queued.
        errors = finished(raw.outputs_until(lambda m: {"deep-add", "str-prompt"} <= set(finished(m)), 10))
        assert all(o.finish_reason == FinishReason.ERROR for o in errors.values())
        assert "extra-frame" not in errors
    # A frame over the cap: libzmq drops the sender's connection before reading it.
    ctx = zmq.Context()
    try:
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 0)
        big.monitor("inproc://big-monitor", zmq.EVENT_DISCONNECTED)
        mon = ctx.socket(zmq.PAIR)
        mon.connect("inproc://big-monitor")
        big.connect(address)
        big.send_multipart([ADD, b"\x00" * (MAX_MESSAGE_BYTES + 1)], copy=False)
        assert mon.poll(30_000), "the core kept the connection of an oversized frame's sender"
    finally:
        ctx.destroy(linger=0)
    assert core_proc.poll() is None
    engine = AsyncLLM.from_config(client_config(long_model_dir, address))
    try:
        assert len(await generate_all(engine, "after-faults", 30)) == 30
    finally:
        engine.shutdown()


async def test_out_of_range_ids_from_the_wire_fail_that_request_alone(
        core: tuple[str, subprocess.Popen], long_model_dir: str) -> None:
    """A request crafted on the wire (no front-end checks): eos far out of range plus
    min_tokens once killed the sampler's penalty step; now it gets an ERROR output."""
    address, _ = core
    engine = AsyncLLM.from_config(client_config(long_model_dir, address))
    try:
        good = [asyncio.create_task(generate_all(engine, f"good-{i}", 300)) for i in range(4)]
        await asyncio.sleep(0.2)
        bad = {
            "bad-eos": EngineCoreRequest("bad-eos", [1, 2, 3], SamplingParams(max_tokens=8, min_tokens=4),
                                         eos_token_id=10**9),
            "bad-stop": EngineCoreRequest("bad-stop", [1, 2, 3], SamplingParams(
                max_tokens=8, min_tokens=4, stop_token_ids=[10**6])),
            "bad-bias": EngineCoreRequest("bad-bias", [1, 2, 3], SamplingParams(max_tokens=8, logit_bias={10**6: 1.0})),
            "bad-allowed": EngineCoreRequest("bad-allowed", [1, 2, 3], SamplingParams(
                max_tokens=8, allowed_token_ids=[5, 512])),
        }
        with raw_client(address) as raw:
            for r in bad.values():
                raw.send(ADD, r)
            outs = finished(raw.outputs_until(lambda m: set(bad) <= set(finished(m))))
        for rid in bad:
            assert outs[rid].finish_reason == FinishReason.ERROR and outs[rid].error, outs[rid]
        assert "eos_token_id" in (outs["bad-eos"].error or "")
        assert [len(ids) for ids in await asyncio.gather(*good)] == [300] * 4
        assert not engine.errored
    finally:
        engine.shutdown()


# -------------------------------------------------------------- 4. ids per front-end


def _run_clients(clients: list[Any], ids: list[str], max_tokens: int, step: Any) -> list[dict[str, list[int]]]:
    """Submit `ids` from every client; the tokens each client got per id, once all finished."""
    tokens: list[dict[str, list[int]]] = [{rid: [] for rid in ids} for _ in clients]
    done: list[set[str]] = [set() for _ in clients]
    for c in clients:
        for rid in ids:
            c.add_request(EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
    deadline = time.monotonic() + 60
    while any(len(d) < len(ids) for d in done):
        assert time.monotonic() < deadline, done
        for i, outs in step():
            for o in outs:
                assert o.request_id in tokens[i] and o.request_id not in done[i], o
                assert o.error is None, o.error
                tokens[i][o.request_id] += o.new_token_ids
                if o.finished:
                    done[i].add(o.request_id)
    return tokens


def test_same_ids_from_two_clients_in_engine_core(long_model_dir: str) -> None:
    from tidal.core.engine_core import EngineCore

    engine = EngineCore(EngineConfig(model=long_model_dir, model_runner="null", max_model_len=4096))
    a, b = b"client-a", b"client-b"

    class Client:
        def __init__(self, index: bytes) -> None:
            self.index = index

        def add_request(self, r: EngineCoreRequest) -> None:
            engine.add_request(r, self.index)

    def step() -> list[tuple[int, list[EngineCoreOutput]]]:
        by_client = engine.step()
        assert set(by_client) <= {a, b}
        return [(i, by_client[c].outputs) for i, c in enumerate((a, b)) if c in by_client]

    try:
        tokens = _run_clients([Client(a), Client(b)], ["0", "1"], 20, step)
        assert [[len(t) for t in client.values()] for client in tokens] == [[20, 20], [20, 20]]
        # A client aborts only its own request of that id.
        engine.add_request(EngineCoreRequest("x", [1], SamplingParams(max_tokens=1000, ignore_eos=True)), a)
        engine.add_request(EngineCoreRequest("x", [1], SamplingParams(max_tokens=1000, ignore_eos=True)), b)
        engine.step()
        engine.abort_requests(["x"], b)
        outs = engine.step()
        assert [o.finish_reason for o in outs[b].outputs] == [FinishReason.ABORT]
        assert [o.request_id for o in outs[a].outputs] == ["x"] and not outs[a].outputs[0].finished
        assert engine.drop_client(a) == 1 and not engine.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_same_ids_from_two_front_ends_on_a_headless_core(core: tuple[str, subprocess.Popen],
                                                         long_model_dir: str) -> None:
    address, _ = core
    clients = [SyncMPClient(client_config(long_model_dir, address)) for _ in range(2)]
    try:
        for c in clients:
            c.wait_ready()

        def step() -> list[tuple[int, list[EngineCoreOutput]]]:
            got = []
            for i, c in enumerate(clients):
                outs = c.get_output(0.05)
                if outs is not None:
                    got.append((i, outs.outputs))
            return got

        tokens = _run_clients(clients, ["0", "1", "2"], 50, step)
        assert [[len(t) for t in client.values()] for client in tokens] == [[50] * 3, [50] * 3]
    finally:
        for c in clients:
            c.shutdown()


# ---------------------------------------------------------- 5. wildcard addresses


@pytest.mark.parametrize("host", ["*", "", "0", "0.0", "0x0", "000.000.000.000", "0.0.0.0", "::",
                                  "[::]", "[0:0::0]", "[::ffff:0.0.0.0]"])
def test_every_spelling_of_a_wildcard_is_refused(host: str) -> None:
    with pytest.raises(ValueError, match="wildcard"):
        validate_address(f"tcp://{host}:5999")


@pytest.mark.parametrize("host", ["127.0.0.1", "[::1]", "localhost"])
def test_specific_addresses_are_accepted(host: str) -> None:
    assert validate_address(f"tcp://{host}:5999") == f"tcp://{host}:5999"


def test_unresolvable_host_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot resolve"):
        validate_address("tcp://no-such-host.invalid:5999")


# ------------------------------------------------------------------ 6. memory kept


def test_finished_and_aborted_requests_are_not_kept(long_model_dir: str) -> None:
    from tidal.core.engine_core import EngineCore

    engine = EngineCore(EngineConfig(model=long_model_dir, model_runner="null", max_model_len=4096,
                                     enable_prefix_caching=False))
    try:
        refs = []
        for i in range(40):
            engine.add_request(EngineCoreRequest(str(i), list(range(1, 40)),
                                                 SamplingParams(max_tokens=5 + i, ignore_eos=True)), b"fe")
            refs.append(weakref.ref(engine.scheduler.requests[f"{i}\x00{b'fe'.hex()}"]))
        engine.step()
        engine.abort_requests([str(i) for i in range(0, 40, 3)], b"fe")
        engine.add_request(EngineCoreRequest("rejected", [10**6], SamplingParams()), b"fe")
        for _ in range(200):
            if not engine.has_unfinished_requests():
                break
            engine.step()
        engine.step()  # the last outputs leave the outbox
        gc.collect()
        assert [r for r in refs if r() is not None] == []
        assert not engine.scheduler.requests and not engine._outbox
    finally:
        engine.shutdown()


def test_rejected_big_request_is_not_kept_by_the_core(tmp_path: Any, long_model_dir: str) -> None:
    """A request the core rejects must be freed once its ERROR is out, while the core idles
    (the busy loop's and the IO thread's loop variables once kept the last one)."""
    from tidal.core.core_proc import EngineCoreProc

    address = f"ipc://{tmp_path}/core"
    proc = EngineCoreProc(EngineConfig(model=long_model_dir, model_runner="null", max_model_len=4096), address)
    code: list[int] = []
    thread = threading.Thread(target=lambda: code.append(proc.run()), daemon=True)
    thread.start()
    n = 4_000_000  # one byte each on the wire; 8 bytes each (32 MB) once decoded
    try:
        with raw_client(address) as raw:
            raw.stats()  # the engine is up
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                raw.send(ADD, EngineCoreRequest("big", [1] * n, SamplingParams()))
                out = finished(raw.outputs_until(lambda m: "big" in finished(m)))["big"]
                assert out.finish_reason == FinishReason.ERROR and "max_model_len" in (out.error or "")
                deadline = time.monotonic() + 10
                while (held := tracemalloc.get_traced_memory()[0] - base) > n:  # a quarter of it
                    assert time.monotonic() < deadline, f"{held} bytes still held after the rejection"
                    time.sleep(0.1)
            finally:
                tracemalloc.stop()
    finally:
        proc.input_queue.put((b"test-over", b"", "test over"))  # ends the busy loop
        thread.join(30)
    assert not thread.is_alive()
