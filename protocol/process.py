"""Process helpers every tidal child uses: die with the parent, reap children, free ports."""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys

_PR_SET_PDEATHSIG = 1


class ParentWatch:
    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid

    def alive(self) -> bool:
        # Re-parenting (to init or a subreaper) means the parent is gone.
        return os.getppid() == self.parent_pid


def exit_with_parent(sig: int = signal.SIGKILL) -> ParentWatch:
    """Ask the kernel to signal us when our parent dies (Linux), and return a poller for the
    other platforms and for the window before the call took effect."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        except OSError:
            pass
    if os.getppid() != parent:  # died before prctl took effect
        os._exit(1)
    return ParentWatch(parent)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> int | None:
    """Terminate, then kill after `timeout_s`, and always reap. Returns the exit code."""
    if proc.poll() is None:
        try:
            proc.terminate()
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                return None
    return proc.returncode
