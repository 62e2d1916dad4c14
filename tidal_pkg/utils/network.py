"""TCP ports for tidal's servers and rendezvous: a listening socket that holds its port, and a
port that was free a moment ago."""
from __future__ import annotations

import socket


def listen_socket(host: str = "127.0.0.1", backlog: int = 128) -> socket.socket:
    """A TCP socket already bound to a kernel-chosen free port and listening: the port is
    held from this moment, so nothing else on the host can take it (no choose-then-bind race).
    Hand its fd to the process that serves it (subprocess `pass_fds`)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((host, 0))
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
