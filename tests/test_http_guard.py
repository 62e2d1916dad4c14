"""The write bound of `tidal serve`'s HTTP protocol (frontend/entrypoints/openai/http_guard.py)
on a real TCP connection, without a server: what counts as the client reading is the kernel's
count of bytes it acknowledged, not the transport buffer draining (which a growing kernel send
buffer also does); a cut-off is a reset. Seconds-long bounds shortened to 0.3 s."""
from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Iterator

import pytest
from uvicorn.protocols.http.flow_control import FlowControl

from tidal.frontend.entrypoints.openai.http_guard import guarded_protocol

TIMEOUT_S = 0.3


class FakeTransport:
    """The parts of an asyncio transport the guard uses, over a real socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.aborted = False

    def get_extra_info(self, name: str) -> object:
        return self.sock if name == "socket" else None

    def is_closing(self) -> bool:
        return self.aborted

    def abort(self) -> None:
        self.aborted = True


@pytest.fixture
def conn() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(server side, client side) of a loopback TCP connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    yield server, client
    server.close()
    client.close()


def guard(loop: asyncio.AbstractEventLoop, server: socket.socket) -> tuple[object, FakeTransport]:
    cls = guarded_protocol(read_timeout=0, write_timeout=TIMEOUT_S)
    proto = cls.__new__(cls)  # only the write bound's state: no uvicorn config or app
    transport = FakeTransport(server)
    proto.loop, proto.transport, proto.flow = loop, transport, FlowControl(transport)  # type: ignore[arg-type]
    proto._read_timer = proto._write_timer = None
    proto._acked_at_pause = None
    return proto, transport


def linger(sock: socket.socket) -> tuple[int, int]:
    return struct.unpack("ii", sock.getsockopt(socket.SOL_SOCKET, socket.SO_LINGER, 8))


def test_a_drain_without_the_client_taking_bytes_does_not_reset_the_bound(conn) -> None:
    server, _client = conn

    async def run() -> FakeTransport:
        proto, transport = guard(asyncio.get_running_loop(), server)
        proto.pause_writing()
        await asyncio.sleep(TIMEOUT_S / 3)
        proto.resume_writing()  # the buffer drained, into the kernel: the client took nothing
        await asyncio.sleep(TIMEOUT_S)
        return transport

    transport = asyncio.run(run())
    assert transport.aborted
    assert linger(server) == (1, 0)  # a reset: the kernel drops what it still holds


def test_a_client_that_takes_bytes_keeps_its_connection(conn) -> None:
    server, client = conn

    async def run() -> FakeTransport:
        proto, transport = guard(asyncio.get_running_loop(), server)
        proto.pause_writing()
        for _ in range(4):  # over the mark the whole time, but the client takes bytes in
            await asyncio.sleep(TIMEOUT_S / 2)
            server.send(b"x" * 100)
            await asyncio.sleep(0.01)
            assert client.recv(100)
        assert not transport.aborted
        proto.resume_writing()  # now it drains because the client read: the bound is off
        await asyncio.sleep(TIMEOUT_S * 1.5)
        return transport

    transport = asyncio.run(run())
    assert not transport.aborted
    assert linger(server) == (0, 0)
