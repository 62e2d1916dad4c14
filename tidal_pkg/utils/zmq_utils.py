"""ZeroMQ socket and address helpers shared by the front-end, the core and the workers.

Local sockets are `ipc://` paths inside a private (0700) temp directory that its creator removes;
TCP binds exactly the address given (loopback by default), never a wildcard.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import shutil
import socket
import tempfile
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import zmq

if TYPE_CHECKING:
    from tidal.utils.curve import Curve

LOOPBACK = "127.0.0.1"


class IpcDir:
    """A private directory for ipc socket files; `cleanup()` removes it and everything inside."""

    def __init__(self, prefix: str = "tidal-") -> None:
        self.path = tempfile.mkdtemp(prefix=prefix)  # mkdtemp creates it 0700
        os.chmod(self.path, 0o700)

    def address(self, name: str) -> str:
        return f"ipc://{os.path.join(self.path, name)}"

    def cleanup(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def validate_address(address: str) -> str:
    """Reject wildcard binds and unsupported schemes with a clear message.

    The host is resolved, not matched as text: `0`, `0.0`, `0x0`, `000.000.000.000`, `::`,
    `[0:0::0]` and `::ffff:0.0.0.0` all mean "every interface" to the resolver that libzmq
    uses too. A host that does not resolve is accepted only as a network interface name
    (which libzmq binds to that interface's address)."""
    if address.startswith("ipc://"):
        if len(address) <= len("ipc://"):
            raise ValueError(f"empty ipc path in address {address!r}")
        return address
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad TCP port in address {address!r}")
        if _binds_every_interface(host):
            raise ValueError(
                f"refusing to bind a wildcard address {address!r}: name the interface "
                f"explicitly (tcp://{LOOPBACK}:PORT for local use)"
            )
        return address
    raise ValueError(f"address must start with ipc:// or tcp://, got {address!r}")


def _binds_every_interface(host: str) -> bool:
    """True for '*', '' and any spelling the resolver turns into an unspecified address."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if host in ("", "*"):
        return True
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        if host in {name for _, name in socket.if_nameindex()}:
            return False
        raise ValueError(f"cannot resolve host {host!r} (name an interface or its address)") from None
    return any(_is_unspecified(str(info[4][0])) for info in infos)


def _is_unspecified(text: str) -> bool:
    addr = ipaddress.ip_address(text.split("%", 1)[0])  # drop an IPv6 scope id
    mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
    return addr.is_unspecified or (mapped is not None and mapped.is_unspecified)


# Largest frame a core accepts from a front-end: libzmq drops a connection that announces a
# bigger one before reading it. A legitimate request (prompt, allowed/bad token ids, logit
# bias) is a few MB at most; the cap keeps a hostile or broken peer from making the core
# allocate and decode hundreds of MB.
MAX_MESSAGE_BYTES = 64 << 20


@dataclass(frozen=True)
class Heartbeat:
    """ZMTP heartbeats: a connection whose peer answers no PING for `timeout_s` (a frozen or
    vanished host, no FIN) is dropped. libzmq copies these options into a connection when
    connect()/bind() creates it, so make_socket sets them before either."""

    timeout_s: float

    def apply(self, sock: zmq.Socket) -> None:
        timeout_ms = max(1, int(self.timeout_s * 1000))
        # Several PINGs per timeout, so one lost to a busy link does not decide; at most 2 s apart.
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(50, min(2_000, timeout_ms // 5)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        # Sent in each PING: the peer drops us too if it hears nothing from us this long.
        sock.setsockopt(zmq.HEARTBEAT_TTL, min(timeout_ms, 6_553_500))  # libzmq's maximum TTL


def make_socket(
    ctx: zmq.Context, address: str, socket_type: int, *, bind: bool, identity: bytes | None = None,
    linger_ms: int = 0, heartbeat: Heartbeat | None = None, max_message_bytes: int | None = None,
    curve: Curve | None = None, before_connect: Callable[[zmq.Socket], None] | None = None,
) -> zmq.Socket:
    """Every option is set before bind/connect: libzmq applies options to a connection when
    it is made, so one set afterwards never reaches it. `curve`: CURVE security (see
    tidal_pkg/utils/curve.py), server side when binding a keyed core, client side when connecting.
    `before_connect(sock)`: runs last before bind/connect (a monitor that must see every event)."""
    sock = ctx.socket(socket_type)
    try:
        sock.setsockopt(zmq.LINGER, linger_ms)
        # No high-water mark drops: a lagging peer slows the sender instead of losing messages.
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        if identity is not None:
            sock.setsockopt(zmq.IDENTITY, identity)
        if heartbeat is not None:
            heartbeat.apply(sock)
        if max_message_bytes is not None:
            sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if curve is not None:
            curve.apply(sock)
        if before_connect is not None:
            before_connect(sock)
        if bind:
            sock.bind(validate_address(address))
        else:
            sock.connect(address)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def ipc_path(address: str) -> str | None:
    return address[len("ipc://"):] if address.startswith("ipc://") else None


@contextlib.contextmanager
def zmq_context() -> Iterator[zmq.Context]:
    ctx = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def request_until_answered(address: str, payload: bytes, stop: threading.Event, try_s: float = 2.0) -> bytes | None:
    """Send `payload` to the REP socket at `address` until it answers (a fresh REQ per try: a
    request lost to a peer that was not up yet leaves no stuck socket); the answer, or None
    once `stop` is set. Each try is bounded by `try_s`."""
    ctx = zmq.Context()
    try:
        while not stop.is_set():
            sock = ctx.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            sock.send(payload)
            if sock.poll(int(try_s * 1000)):
                answer = sock.recv()
                sock.close()
                return answer
            sock.close()
        return None
    finally:
        ctx.destroy(linger=0)
