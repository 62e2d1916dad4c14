"""TCP ports for tidal's servers and rendezvous: a listening socket that holds its port, and a
port that was free a moment ago."""
from __future__ import annotations

import socket


def listen_socket(host: str = "127.0.0.1", backlog: int = 128, port: int = 0) -> socket.socket:
    """A TCP socket already bound to `port` (0: a kernel-chosen free one) and listening: the port is
    held from this moment, so nothing else on the host can take it (no choose-then-bind race).
    Hand its fd to the process that serves it (subprocess `pass_fds`)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if port:  # a fixed port (a restarted engine's rendezvous) despite its old connections' TIME_WAIT
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        s.listen(backlog)
    except BaseException:
        s.close()
        raise
    return s


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (racy: prefer `listen_socket`, which keeps it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def interface_towards(address: str) -> str | None:
    """The name of this host's network interface that packets to `address` leave by (the
    kernel's route, found by connecting a UDP socket: nothing is sent), or None if unknown."""
    import psutil

    try:
        local = local_address_towards(address)
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


def local_address_towards(address: str) -> str:
    """This host's IPv4 address that packets to `address` leave from (the kernel's route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return str(s.getsockname()[0])
