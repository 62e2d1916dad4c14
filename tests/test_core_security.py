"""A CURVE-keyed headless core (issue 12, Build 5): only front-ends holding its key file are
served; one without the key, or with another key, gets nothing (its handshake times out) and
cannot abort anyone's request; a front-end can abort only its own requests; binding an address
off loopback without a key is refused; key files are written and read 0600 only."""
from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any, Iterator

import psutil
import pytest
import zmq

from tidal.frontend import LLM, AsyncLLM
from tidal.protocol import EngineConfig, RequestOutputKind, SamplingParams
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.utils.curve import Curve, check_bind_security, generate_key_file, load_key_file
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityRequest,
    decode_utility_result,
)

try:
    from conftest import free_tcp_port
    from test_wire_faults import reap
except ImportError:  # tests/ made a package
    from tests.conftest import free_tcp_port  # type: ignore[no-redef]
    from tests.test_wire_faults import reap  # type: ignore[no-redef]

ADD, ABORT, UTILITY = (t.value for t in EngineCoreRequestType)
LONG = 60_000  # null-runner tokens: a stream that is still running while the test probes


def _non_loopback_ipv4() -> str | None:
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return a.address
    return None


# ------------------------------------------------------------------ key files and the bind rule


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def test_keygen_writes_an_owner_only_file_and_never_overwrites(tmp_path: Any) -> None:
    path = str(tmp_path / "core.key")
    res = subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "core-keygen", path],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert os.stat(path).st_mode & 0o777 == 0o600
    key = load_key_file(path, server=True)
    assert len({key.server_public_key, key.server_secret_key, key.client_public_key, key.client_secret_key}) == 4
    before = _read(path)
    res = subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "core-keygen", path],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "exists" in res.stderr
    assert _read(path) == before


def test_key_file_problems_are_named(tmp_path: Any) -> None:
    path = str(tmp_path / "k")
    generate_key_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        load_key_file(path, server=False)
    os.chmod(path, 0o600)
    doc = json.loads(_read(path))
    del doc["server_secret_key"]  # a front-end's copy
    _write(path, json.dumps(doc))
    assert load_key_file(path, server=False).server_secret_key is None
    with pytest.raises(ValueError, match="server_secret_key"):
        load_key_file(path, server=True)
    _write(path, "not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_key_file(path, server=False)
    with pytest.raises(ValueError, match="cannot read"):
        load_key_file(str(tmp_path / "missing"), server=False)


@pytest.mark.parametrize("address", ["tcp://192.0.2.7:5000", "tcp://10.0.0.1:5000", "tcp://[fd00::9]:5000"])
def test_bind_off_loopback_needs_a_key(address: str) -> None:
    with pytest.raises(ValueError, match="without a key"):
        check_bind_security(address, None)
    check_bind_security(address, "/some/key")  # with a key file it is allowed


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:5000", "tcp://localhost:5000", "tcp://[::1]:5000",
                                     "tcp://127.5.6.7:5000", "ipc:///tmp/x/core"])
def test_loopback_and_ipc_need_no_key(address: str) -> None:
    check_bind_security(address, None)


def test_headless_core_refuses_a_keyless_non_loopback_bind(long_model_dir: str) -> None:
    """Both ways of starting a headless core refuse, before loading anything."""
    address = f"tcp://{_non_loopback_ipv4() or '192.0.2.7'}:{free_tcp_port()}"
    config = EngineConfig(model=long_model_dir, model_runner="null").to_json().decode()
    for cmd in (["-m", "tidal.frontend.entrypoints.cli", "core", long_model_dir, "--model-runner", "null"],
                ["-m", "tidal.core.core_proc", "--config-json", config]):
        res = subprocess.run([sys.executable, *cmd, "--address", address],
                             capture_output=True, text=True, timeout=120)
        assert res.returncode != 0 and "without a key" in res.stderr, res.stderr[-2000:]


# ------------------------------------------------------------------ a keyed core end to end


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """(the core's key file, another one: a wrong key)."""
    d = tmp_path_factory.mktemp("keys")
    good, wrong = str(d / "core.key"), str(d / "wrong.key")
    generate_key_file(good)
    generate_key_file(wrong)
    return good, wrong


@pytest.fixture(scope="module")
def keyed_core(long_model_dir: str, keys: tuple[str, str]) -> Iterator[str]:
    """A keyed `tidal core`, on this host's non-loopback address when it has one."""
    address = f"tcp://{_non_loopback_ipv4() or '127.0.0.1'}:{free_tcp_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "core", long_model_dir,
                             "--address", address, "--key-file", keys[0], "--model-runner", "null",
                             "--max-model-len", "65536", "--max-num-seqs", "16"])
    try:
        yield address
        assert proc.poll() is None, "the keyed core must survive everything the tests sent"
    finally:
        reap(proc)
        assert proc.returncode == 0
        assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE


class Dealer:
    """A hand-made front-end socket: keyless (curve None), wrong-keyed or keyed."""

    def __init__(self, ctx: zmq.Context, address: str, curve: Curve | None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        # A refused (keyless or wrong-keyed) connection may leave no pipe to queue into: a send
        # then blocks, so it gets a bound like every other wait (zmq.Again after 5 s).
        self.sock.setsockopt(zmq.SNDTIMEO, 5000)
        if curve is not None:
            curve.apply(self.sock)
        self.sock.connect(address)
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

    def send(self, kind: bytes, obj: object) -> bool:
        """True once queued; False when the socket had no connection to queue it on (5 s)."""
        try:
            self.sock.send_multipart([kind, *self.encoder.encode(obj)])
            return True
        except zmq.Again:
            return False

    def stats(self, timeout_s: float) -> Any:
        """get_stats, or None when nothing answers within timeout_s."""
        if not self.send(UTILITY, UtilityRequest(77, "get_stats")):
            return None  # not even queued: no connection the core accepted
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000)):
                return None
            outs = self.decoder.decode(self.sock.recv_multipart())
            if outs.utility_output is not None and outs.utility_output.call_id == 77:
                return decode_utility_result("get_stats", outs.utility_output.result)
        return None


def _client_curve(key_file: str) -> Curve:
    key = load_key_file(key_file, server=False)
    return Curve(key.client_public_key, key.client_secret_key, server_key=key.server_public_key)


async def _stream(engine: AsyncLLM, rid: str, max_tokens: int, started: asyncio.Event) -> int:
    n = 0
    async for out in engine.generate("abc", SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                                           output_kind=RequestOutputKind.DELTA), rid):
        n += len(out.outputs[0].token_ids)
        started.set()
    return n


async def test_only_key_holders_are_served_and_abort_only_their_own(
        keyed_core: str, keys: tuple[str, str], long_model_dir: str) -> None:
    address, (good_key, wrong_key) = keyed_core, keys
    engine = AsyncLLM(model=long_model_dir, core_address=address, core_key_file=good_key,
                      engine_start_timeout_s=60)
    ctx = zmq.Context()
    try:
        started = asyncio.Event()
        stream = asyncio.ensure_future(_stream(engine, "r1", LONG, started))
        await asyncio.wait_for(started.wait(), 60)
        wire_id = engine._running["r1"]  # the id the core knows the request by
        outsiders = [Dealer(ctx, address, None), Dealer(ctx, address, _client_curve(wrong_key))]
        # A second key holder, with an identity of its own: a legitimate front-end.
        other = Dealer(ctx, address, _client_curve(good_key))
        for d in (*outsiders, other):  # an outsider's send may not even be queued: either way
            sent = d.send(ABORT, [wire_id])
            sent = d.send(ADD, EngineCoreRequest("x", [1, 2, 3], SamplingParams(max_tokens=LONG, ignore_eos=True))) and sent
            assert sent or d is not other
        # The other key holder's messages arrived in order: its abort (of an id that is not
        # its own) was applied before this answer, and r1 still runs; so does its own "x".
        stats = await asyncio.to_thread(other.stats, 60)
        assert stats is not None and stats.num_running_reqs + stats.num_waiting_reqs == 2, stats
        for d in outsiders:  # no answer at all, not even to a utility call
            assert await asyncio.to_thread(d.stats, 3) is None
        assert other.send(ABORT, ["x"])  # its own request: that abort works
        assert await asyncio.wait_for(stream, 120) == LONG  # r1 untouched by anyone's abort
        stats = await asyncio.to_thread(other.stats, 60)
        assert stats.num_running_reqs + stats.num_waiting_reqs == 0, stats
        assert not engine.errored
    finally:
        ctx.destroy(linger=0)
        engine.shutdown()


def _with_other_client_key(good_key: str, path: str) -> str:
    """A copy of the core's key file whose client keypair is another one: the right server key,
    a client key the core's ZAP handler refuses."""
    raw = json.loads(open(good_key).read())
    public, secret = zmq.curve_keypair()
    raw.update(client_public_key=public.decode(), client_secret_key=secret.decode())
    raw.pop("server_secret_key")
    with open(path, "w") as f:
        json.dump(raw, f)
    os.chmod(path, 0o600)
    return path


@pytest.mark.parametrize(("which", "words"), [
    # A keyed core often hangs up on a keyless front-end before libzmq says why: then the
    # front-end's fallback still names the cause and core_key_file.
    ("keyless", "(is keyed \\(CURVE\\) and this front-end has no key: pass core_key_file"
                "|a keyed \\(CURVE\\) core does this to a front-end without its key \\(pass core_key_file)"),
    ("another key file", "the server key in core_key_file is not this core's key"),
    ("another client key", "refused this front-end's CURVE key: core_key_file must be a copy"),
])
def test_front_end_without_the_key_is_told_which_key_is_wrong(
        keyed_core: str, keys: tuple[str, str], long_model_dir: str, tmp_path: Any, which: str, words: str) -> None:
    """The core never answers a front-end it refused; the front-end reads its DEALER's
    handshake events, so it fails at once naming the key, not after engine_start_timeout_s
    with "no handshake" (a 120 s timeout here: the timeout's message would not match)."""
    kwargs = {"keyless": {}, "another key file": {"core_key_file": keys[1]},
              "another client key": {"core_key_file": _with_other_client_key(keys[0], str(tmp_path / "c.key"))}}
    with pytest.raises(RuntimeError, match=f"engine core failed to start: the core at .* {words}"):
        AsyncLLM(model=long_model_dir, core_address=keyed_core, engine_start_timeout_s=120, **kwargs[which])


def test_serve_with_a_wrong_key_exits_naming_the_key(keyed_core: str, keys: tuple[str, str], long_model_dir: str,
                                                    tidal_cache_dir: str) -> None:
    """`tidal serve` against the keyed core with another key file exits at once with words
    that name the key, not after --engine-start-timeout-s (120 s here, past this test's
    limit) with "no handshake"."""
    from tidal.utils.network import free_port

    env = {k: v for k, v in os.environ.items() if k not in ("TIDAL_API_KEY", "VLLM_API_KEY")}
    env["TIDAL_CACHE_DIR"] = tidal_cache_dir
    res = subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", "serve", long_model_dir,
                          "--port", str(free_port()), "--core-address", keyed_core, "--core-key-file", keys[1],
                          "--engine-start-timeout-s", "120"], capture_output=True, text=True, timeout=100, env=env)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-2000:]
    assert "the server key in core_key_file is not this core's key" in out, out[-2000:]


def test_llm_with_the_key_is_served(keyed_core: str, keys: tuple[str, str], long_model_dir: str) -> None:
    with LLM(model=long_model_dir, core_address=keyed_core, core_key_file=keys[0],
             engine_start_timeout_s=60) as llm:
        out = llm.generate(["a", "b"], SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [5, 5]
