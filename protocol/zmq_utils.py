"""ZeroMQ socket and address helpers shared by the front-end, the core and the workers.

Local sockets are `ipc://` paths inside a private (0700) temp directory that its creator removes;
TCP binds exactly the address given (loopback by default), never a wildcard.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from typing import Iterator

import zmq

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
    """Reject wildcard binds and unsupported schemes with a clear message."""
    if address.startswith("ipc://"):
        if len(address) <= len("ipc://"):
            raise ValueError(f"empty ipc path in address {address!r}")
        return address
    if address.startswith("tcp://"):
        host, _, port = address[len("tcp://"):].rpartition(":")
        if host in ("*", "0.0.0.0", "[::]", ""):
            raise ValueError(
                f"refusing to bind a wildcard address {address!r}: name the interface "
                f"explicitly (tcp://{LOOPBACK}:PORT for local use)"
            )
        if not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"bad TCP port in address {address!r}")
        return address
    raise ValueError(f"address must start with ipc:// or tcp://, got {address!r}")


def make_socket(
    ctx: zmq.Context, address: str, socket_type: int, *, bind: bool, identity: bytes | None = None,
    linger_ms: int = 0,
) -> zmq.Socket:
    sock = ctx.socket(socket_type)
    sock.setsockopt(zmq.LINGER, linger_ms)
    # No high-water mark drops: a lagging peer slows the sender instead of losing messages.
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity)
    if bind:
        sock.bind(validate_address(address))
    else:
        sock.connect(address)
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
