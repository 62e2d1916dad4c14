"""`tidal serve`'s request and process life cycle: a client that disconnects mid-stream leaves
nothing running in the core; SIGTERM with streams in flight exits within --shutdown-timeout and
leaves no child process. The null model runner (one token per step) keeps requests long."""
from __future__ import annotations

import asyncio
import json
import subprocess
import threading
import time
from collections.abc import Iterator

import openai
import psutil
import pytest

from tests.server_utils import STOP_TIMEOUT_S, Server, wait_for

# Long enough (60k null-runner steps) never to finish by itself while a test runs.
LONG = 60_000
FLAGS = ["--model-runner", "null", "--max-model-len", "65536", "--num-kv-blocks", "20000", "--max-num-seqs", "16"]


@pytest.fixture(scope="module")
def server(long_model_dir: str, tidal_cache_dir: str) -> Iterator[Server]:
    srv = Server(long_model_dir, FLAGS, tidal_cache_dir)
    yield srv
    srv.stop()


def _core_idle(srv: Server) -> bool:
    m = srv.metrics()
    return m["vllm:num_requests_running"] == 0 and m["vllm:num_requests_waiting"] == 0


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_mid_stream_aborts_in_core(server: Server, n: int) -> None:
    stream = server.client().completions.create(model=server_model(server), prompt="Hello", max_tokens=LONG,
                                                n=n, stream=True, extra_body={"ignore_eos": True})
    for got, _chunk in enumerate(stream, 1):
        if got == 5:
            break
    assert server.metrics()["vllm:num_requests_running"] >= 1  # still generating
    stream.close()  # the client goes away mid-stream
    wait_for(lambda: _core_idle(server), 60, "the core to have no unfinished request")


def test_disconnect_while_waiting_for_a_whole_response(server: Server) -> None:
    """An unstreamed request is aborted too when its client leaves (here: a client timeout)."""
    client = server.client(timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        client.completions.create(model=server_model(server), prompt="Hello", max_tokens=LONG,
                                  extra_body={"ignore_eos": True})
    wait_for(lambda: _core_idle(server), 60, "the core to have no unfinished request")


def test_storm_of_abandoned_requests_leaves_nothing_behind(server: Server) -> None:
    """40 requests (streamed and not) whose clients close their connections 0.3 s after
    sending, without reading: every one is dropped from the core, and the next request gets
    its whole answer (scripts/bench_abandoned.py times it against an idle server)."""
    port = int(server.url.rsplit(":", 1)[1])
    model = server_model(server)

    async def abandoned(i: int) -> None:
        body = json.dumps({"model": model, "prompt": f"storm {i}", "max_tokens": LONG, "stream": i % 2 == 0,
                           "ignore_eos": True}).encode()
        reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 30)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), 10)

    async def storm() -> None:
        await asyncio.gather(*(abandoned(i) for i in range(40)))

    asyncio.run(storm())
    wait_for(lambda: _core_idle(server), 60, "the core to drop every abandoned request")
    out = server.client().completions.create(model=model, prompt="fresh", max_tokens=8,
                                             extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    assert _core_idle(server)


def server_model(server: Server) -> str:
    return server.client().models.list().data[0].id


def test_sigterm_with_streams_in_flight(long_model_dir: str, tidal_cache_dir: str) -> None:
    timeout_s = 2.0
    srv = Server(long_model_dir, [*FLAGS, "--shutdown-timeout", str(timeout_s)], tidal_cache_dir)
    try:
        children = srv.children()
        assert children, "the engine core should be a child of the server"
        started = threading.Barrier(5, timeout=120)
        ended: list[str] = []

        def stream_one() -> None:
            try:
                stream = srv.client().completions.create(model=server_model(srv), prompt="Hi", max_tokens=LONG,
                                                         stream=True, extra_body={"ignore_eos": True})
                for i, _chunk in enumerate(stream):
                    if i == 2:
                        started.wait()
                ended.append("eof")
            except Exception as e:  # the server cut the stream off at its shutdown timeout
                ended.append(type(e).__name__)

        threads = [threading.Thread(target=stream_one, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        started.wait()  # all four are streaming
        t0 = time.monotonic()
        srv.proc.terminate()
        code = srv.proc.wait(timeout_s + STOP_TIMEOUT_S)
        elapsed = time.monotonic() - t0
        for t in threads:
            t.join(60)
        assert code == 0, srv.output()
        assert len(ended) == 4
        _gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, f"left running: {[p.pid for p in alive]}"
        assert elapsed < timeout_s + STOP_TIMEOUT_S
    finally:
        srv.stop()


def test_sigterm_lets_short_requests_finish(long_model_dir: str, tidal_cache_dir: str) -> None:
    srv = Server(long_model_dir, [*FLAGS, "--shutdown-timeout", "60"], tidal_cache_dir)
    try:
        stream = srv.client().completions.create(model=server_model(srv), prompt="Hi", max_tokens=2000,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        srv.proc.terminate()
        rest = list(chunks)  # the in-flight stream runs to its end
        assert rest[-1].usage.completion_tokens == 2000
        assert srv.proc.wait(STOP_TIMEOUT_S) == 0
    except subprocess.TimeoutExpired:
        pytest.fail("the server did not exit after its last request finished")
    finally:
        srv.stop()
