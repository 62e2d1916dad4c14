"""Connection-level time bounds for `tidal serve`: a client that is slow to send its request
or slow to read its response costs only its own connection.

uvicorn bounds neither. Its `timeout_keep_alive` covers only the idle time between requests:
once a byte of the next request arrives it is off, so a client that sends its headers a byte
at a time (slowloris), or never finishes its body, held its connection forever. And a response
whose client does not read waits in `send()` on the transport's drain with no bound: its
request kept running in the engine (its outputs merged unread in the request's queue, logprobs
and all), and the connection, the request's state and its unsent output stayed for as long as
the client kept the socket open. 500 such streams with logprobs=20 had the engine generate and
the front end detokenize for nobody, stalling every other client and /health for 25-55 s.

`guarded_protocol()` is uvicorn's httptools protocol with both bounds (uvicorn.Config's `http`):

- read: a request's headers must be in within `read_timeout` seconds of its first byte (or of
  the connection's opening: a connection that sends nothing is closed too), and its body may
  pause no longer than that between reads; else a JSON 408 (when no response has started) and
  the connection is closed. The app, if it was reading the body, sees a disconnect.
- write: once the transport's write buffer has gone over its high-water mark (64 KiB, on top
  of a full kernel socket buffer), a client that takes in no byte of it for `write_timeout`
  seconds has its connection aborted. "Takes in" is the kernel's count of bytes the peer
  acknowledged (TCP_INFO), not the buffer's level: the buffer also drains when the kernel
  grows its send buffer, and a bound reset by that let a stream nobody read run to its end
  under load. uvicorn reports the disconnect to the app, so CancelOnDisconnect cancels the
  request's task, which closes its generate() streams: the engine aborts the request at once.

A timeout of 0 turns its bound off.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from http import HTTPStatus
from typing import Any

from tidal.frontend.entrypoints.openai.errors import APIError
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

logger = logging.getLogger("tidal.frontend.entrypoints.openai.api_server")

DEFAULT_READ_TIMEOUT_S = 30.0
DEFAULT_WRITE_TIMEOUT_S = 30.0
_RECHECK_S = 0.2  # a timed-out read with bytes still unread is looked at again after this


def _unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes waiting in the connection's kernel receive buffer (0 when it cannot be told)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except (OSError, ValueError):
        return 0
    return int(struct.unpack("i", buf)[0])


_TCPI_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info (4.1+)


def _bytes_acked(transport: asyncio.BaseTransport) -> int | None:
    """Bytes of the response the peer has acknowledged so far (None when it cannot be told)."""
    sock = transport.get_extra_info("socket")
    tcp_info = getattr(socket, "TCP_INFO", None)
    if sock is None or tcp_info is None:
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, tcp_info, _TCPI_BYTES_ACKED + 8)
    except (OSError, ValueError):
        return None
    if len(info) < _TCPI_BYTES_ACKED + 8:
        return None
    return int(struct.unpack_from("Q", info, _TCPI_BYTES_ACKED)[0])


def _timeout_response(seconds: float) -> bytes:
    """The raw 408 for a request that did not arrive in time (OpenAI's error shape)."""
    body = APIError(f"Request not received within {seconds:g} s (--request-read-timeout)",
                    HTTPStatus.REQUEST_TIMEOUT).encode()
    head = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n")
    return head + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """HttpToolsProtocol with the read and write bounds (class attributes: guarded_protocol()
    makes a subclass with the server's values)."""

    read_timeout: float = DEFAULT_READ_TIMEOUT_S
    write_timeout: float = DEFAULT_WRITE_TIMEOUT_S

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._acked_at_pause: int | None = None

    # ---------------------------------------------------------------- read bound
    def _arm_read(self) -> None:
        self._cancel_read()
        if self.read_timeout > 0:
            self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _cancel_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self.transport.is_closing():
            return
        if self.flow.read_paused:  # the app has not taken the body it has: not the client's delay
            self._arm_read()
            return
        if _unread_bytes(self.transport):
            # Sent, but not read yet: a loop that was busy runs its timers before it polls its
            # sockets. Look again once it has read them (a client that dribbles is caught then).
            self._read_timer = self.loop.call_later(_RECHECK_S, self._read_timed_out)
            return
        cycle = self.cycle
        if cycle is None or cycle.response_complete or not cycle.response_started:
            self.transport.write(_timeout_response(self.read_timeout))
        if cycle is not None and not cycle.response_complete:
            # What connection_lost will do, now: the app reading the body gets a disconnect,
            # and whatever it sends is dropped (the 408 above is the connection's last word).
            cycle.disconnected = True
            cycle.message_event.set()
        logger.info("closed a connection whose request did not arrive within %g s (--request-read-timeout)",
                    self.read_timeout)
        self.transport.close()  # connection_lost tells a running app its client is gone

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read()  # a connection that never sends a request is closed too

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_read()  # from the request's first byte, its headers have read_timeout

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        if self._read_timer is not None:
            self._arm_read()  # the body: no pause longer than read_timeout

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        if self._read_timer is not None:
            self._arm_read()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._cancel_read()  # the request is in; the keep-alive timeout covers the idle after it

    # --------------------------------------------------------------- write bound
    # Invariant: _write_timer is set from the first pause_writing after the client's last
    # progress until the client acknowledges a byte more than _acked_at_pause (or, where
    # the kernel cannot tell, until resume_writing).
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._arm_write()

    def _arm_write(self) -> None:
        if self.write_timeout > 0:
            self._acked_at_pause = _bytes_acked(self.transport)
            self._write_timer = self.loop.call_later(self.write_timeout, self._write_timed_out)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._client_progressed():
            self._cancel_write()

    def _client_progressed(self) -> bool:
        before = self._acked_at_pause
        if before is None:
            return True  # no byte count here: the buffer's drain is all there is to go by
        now = _bytes_acked(self.transport)
        return now is None or now > before

    def _cancel_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    def _write_timed_out(self) -> None:
        self._write_timer = None
        if self.transport.is_closing():
            return
        if self._acked_at_pause is None:  # no byte count: the buffer's level is all there is
            stalled = self.flow.write_paused
        else:
            stalled = not self._client_progressed()
        if not stalled:
            if self.flow.write_paused:
                self._arm_write()  # it reads, if slowly, and the buffer is still over: a new period
            return
        logger.info("aborted a connection whose client read nothing for %g s (--response-write-timeout)",
                    self.write_timeout)
        # abort, not close: close would wait to flush the buffer the client does not read. And a
        # reset (linger 0): a plain close leaves the kernel holding the unsent megabytes of its
        # send buffer, retrying a zero window for minutes on a socket nobody owns.
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except (OSError, ValueError):
                pass
        self.transport.abort()

    def handle_websocket_upgrade(self) -> None:
        self._cancel_read()  # the transport is the websocket protocol's from here
        self._cancel_write()
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read()
        self._cancel_write()
        super().connection_lost(exc)


def guarded_protocol(read_timeout: float, write_timeout: float) -> type[GuardedHttpToolsProtocol]:
    """The protocol class for uvicorn.Config(http=...) with these bounds (seconds; 0: none)."""
    if read_timeout < 0 or write_timeout < 0:
        raise ValueError("--request-read-timeout and --response-write-timeout must be >= 0 (0: no bound)")
    return type("TidalHttpProtocol", (GuardedHttpToolsProtocol,),
                {"read_timeout": float(read_timeout), "write_timeout": float(write_timeout)})
