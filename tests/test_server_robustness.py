"""`tidal serve` against hostile inputs and clients: a JSON schema nested past the limit is a 400
naming it (not a 500 traceback from the grammar compiler); clients that never read their
streams, that send their requests a byte at a time or never finish them, and bodies over the
limit cost only their own connections; and the engine stays healthy."""
from __future__ import annotations

import http.client
import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from tests.server_utils import Server, assert_openai_error, http_get, http_request, post_json, wait_for
from tidal.frontend.entrypoints.openai.http_guard import guarded_protocol
from tidal.frontend.entrypoints.openai.request_params import MAX_SCHEMA_DEPTH

# Its liveness bounds (LIVE_S) hold for a front end with a core to itself, not beside another
# test process's engine: README's test command runs this module after the parallel phase.
pytestmark = pytest.mark.serial

READ_TIMEOUT_S = 3  # --request-read-timeout here (30 s by default)
WRITE_TIMEOUT_S = 2  # --response-write-timeout here (30 s by default)
FLAGS = ["--model-runner", "null", "--max-model-len", "2048", "--num-kv-blocks", "16384", "--served-model-name", "m",
         "--request-read-timeout", str(READ_TIMEOUT_S), "--response-write-timeout", str(WRITE_TIMEOUT_S)]
LIVE_S = 10.0  # generous: how soon /health and a small completion must answer meanwhile


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str) -> Iterator[Server]:
    srv = Server(tiny_model_dir, FLAGS, tidal_cache_dir)
    yield srv
    srv.stop()


def nested_schema(depth: int) -> dict[str, Any]:
    """An object schema `depth` levels of {"type", "properties"} deep (built without recursion)."""
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("field", ["response_format", "structured_outputs", "structured_outputs_text"])
def test_deeply_nested_schema_is_400(server: Server, field: str) -> None:
    deep = nested_schema(300)  # 600 levels of JSON: past the schema limit, within the body's
    body: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 2}
    if field == "response_format":
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": deep}}
    elif field == "structured_outputs":
        body["structured_outputs"] = {"json": deep}
    else:
        body["structured_outputs"] = {"json": json.dumps(deep)}
    status, reply = post_json(server.url + "/v1/completions", body)
    assert_openai_error(status, reply, 400)
    assert str(MAX_SCHEMA_DEPTH) in reply["error"]["message"]
    assert "nested" in reply["error"]["message"]
    # A schema within the limit is still accepted, and the engine still serves.
    body = {"model": "m", "prompt": "hi", "max_tokens": 2,
            "structured_outputs": {"json": nested_schema(3)}}
    assert post_json(server.url + "/v1/completions", body)[0] == 200



# ------------------------------------------------------------------ slow or stalled clients
def raw_post(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """A socket that has sent one JSON POST and reads nothing (a tiny receive buffer, so the
    server's side fills up soon)."""
    data = json.dumps(body).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    s.connect(("127.0.0.1", port))
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return s


def read_all(s: socket.socket, timeout: float) -> bytes:
    """What the socket gets until the server closes (or resets) it, or `timeout` passes."""
    s.settimeout(timeout)
    got = b""
    try:
        while chunk := s.recv(1 << 16):
            got += chunk
    except (ConnectionResetError, TimeoutError, socket.timeout):
        pass
    return got


def unfinished(server: Server) -> float:
    m = server.metrics()
    return m.get("vllm:num_requests_running", 0.0) + m.get("vllm:num_requests_waiting", 0.0)


def assert_live(server: Server) -> None:
    """/health and a small completion both answer within LIVE_S."""
    assert http_request("GET", server.url + "/health", timeout=LIVE_S)[0] == 200
    body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 4}).encode()
    status, reply = http_request("POST", server.url + "/v1/completions", body, timeout=LIVE_S)
    assert status == 200, reply


def tcp_state(s: socket.socket) -> int:
    """The socket's state in the kernel (tcp_info's first byte: 1 established, 7 closed)."""
    return s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0]


TCP_CLOSE = 7


def test_unread_streams_cost_only_their_connections(server: Server) -> None:
    """Streams whose clients never read: the others and /health still answer, a stream stuck
    on a full send buffer for --response-write-timeout is cut off (reset, no [DONE]) while its
    client still holds the socket open, its request ends in the engine, and nothing is left
    running."""
    small = {"model": "m", "prompt": "hello", "max_tokens": 200, "stream": True, "logprobs": 20, "ignore_eos": True}
    # n=32 x 1900 tokens each: megabytes of stream, far past what the socket buffers hold.
    large = {**small, "n": 32, "max_tokens": 1900, "logprobs": 5}
    socks = [raw_post(server.port, "/v1/completions", small) for _ in range(150)]
    stuck = [raw_post(server.port, "/v1/completions", large) for _ in range(3)]
    try:
        assert_live(server)
        # Watched without reading (a read would be the client taking bytes in): the server resets
        # each one. Its request may have finished in the engine first (the null runner is fast);
        # the rest of its stream waits unsent, so the bound still applies.
        wait_for(lambda: all(tcp_state(s) == TCP_CLOSE for s in stuck), 120, "the unread streams to be cut off")
        wait_for(lambda: unfinished(server) == 0, 120, "the unread streams' requests to end")
        assert_live(server)
        for s in stuck:
            assert b"data: [DONE]" not in read_all(s, LIVE_S)  # cut off, not finished
    finally:
        for s in socks + stuck:
            s.close()
    wait_for(lambda: unfinished(server) == 0, 30, "no request left in the engine")
    assert_live(server)


def test_slow_request_senders_are_closed(server: Server) -> None:
    """Headers sent a byte at a time, a body never finished, a connection that sends nothing:
    each gets a 408 and is closed within --request-read-timeout (plus slack), while others
    are served meanwhile."""
    dribbler = socket.create_connection(("127.0.0.1", server.port))
    partial_body = socket.create_connection(("127.0.0.1", server.port))
    partial_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"model\": ")
    silent = socket.create_connection(("127.0.0.1", server.port))
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + b"X-Slow: " + b"a" * 200
    closed_by_server = False
    deadline = time.monotonic() + READ_TIMEOUT_S + 30
    try:
        for i, byte in enumerate(head):  # one byte each 0.25 s: the headers would take over 50 s
            if i == 8:
                assert_live(server)  # others are served meanwhile
            if select.select([dribbler], [], [], 0.25)[0]:  # the server answered (408) or closed
                closed_by_server = True
                break
            assert time.monotonic() < deadline, "the byte-by-byte sender was never closed"
            try:
                dribbler.send(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_by_server = True
                break
        assert closed_by_server
        for s in (dribbler, partial_body, silent):
            reply = read_all(s, READ_TIMEOUT_S + 30)  # returns once the server has closed it
            # The 408 may be lost to a reset when the dribbler's next byte met the closed socket.
            if reply or s is not dribbler:
                assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
                assert b"--request-read-timeout" in reply
            assert s.recv(1) == b""  # closed, not timed out
    finally:
        for s in (dribbler, partial_body, silent):
            s.close()
    assert_live(server)


def test_read_and_write_timeouts_are_checked() -> None:
    with pytest.raises(ValueError, match="--request-read-timeout"):
        guarded_protocol(-1, 30)
    assert guarded_protocol(0, 5).write_timeout == 5.0


# ---------------------------------------------------------------------- large bodies
def post_large(port: int, size: int, chunked: bool) -> tuple[int, str | None, bytes]:
    """(status, content type, body) of a POST of `size` bytes, chunked or with Content-Length."""
    data = b"a" * size
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        headers = {"Content-Type": "application/json"}
        if chunked:
            pieces = (data[i:i + (1 << 20)] for i in range(0, size, 1 << 20))
            conn.request("POST", "/v1/completions", body=pieces, headers=headers, encode_chunked=True)
        else:
            conn.request("POST", "/v1/completions", body=data, headers=headers)
        resp = conn.getresponse()
        return resp.status, resp.getheader("content-type"), resp.read()
    finally:
        conn.close()


def test_over_limit_bodies_are_json_413_and_freed(server: Server) -> None:
    """A 64 MiB body over the 32 MiB default limit, chunked or with Content-Length: a JSON 413
    naming the limit, and the server's memory comes back (it kept ~620 MB before malloc_trim)."""
    proc = psutil.Process(server.proc.pid)
    before = proc.memory_info().rss
    for chunked in (True, False, True):
        status, ctype, body = post_large(server.port, 64 << 20, chunked)
        reply = json.loads(body)
        assert_openai_error(status, reply, 413)
        assert ctype == "application/json"
        assert str(32 << 20) in reply["error"]["message"] and "--max-request-body-bytes" in reply["error"]["message"]
    assert proc.memory_info().rss - before < 100 << 20
    assert http_get(server.url + "/health")[0] == 200
