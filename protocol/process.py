"""Process helpers every tidal child uses: die with the parent, reap children, listen sockets.

Parent death on Linux is PR_SET_PDEATHSIG, which the kernel ties to the *thread* that forked
the child, not to its process: a child spawned from a short-lived thread would be signalled
when that thread ends. `SpawnerThread` owns the fork for that reason: it lives exactly as long
as its children should, so the signal fires when the parent process dies (or the spawner is
released) and never because some unrelated thread returned.
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Sequence

from tidal.protocol.utils import Deadline

_PR_SET_PDEATHSIG = 1


class ParentWatch:
    def __init__(self, parent_pid: int) -> None:
        self.parent_pid = parent_pid

    def alive(self) -> bool:
        # Re-parenting (to init or a subreaper) means the parent is gone.
        return os.getppid() == self.parent_pid


def exit_with_parent(sig: int = signal.SIGKILL) -> ParentWatch:
    """Ask the kernel to signal us when our parent (thread) dies (Linux), and return a poller
    for the other platforms and for the window before the call took effect.

    SIGKILL is what a worker wants: it also ends a process blocked inside a C++ collective,
    where no Python signal handler or polling loop would ever run."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # died before prctl took effect
        os._exit(1)
    return ParentWatch(parent)


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


def stop_process(proc: subprocess.Popen, timeout_s: float = 5.0) -> int | None:
    """Terminate, then kill after `timeout_s`, and always reap. Returns the exit code."""
    return stop_processes([proc], timeout_s)[0]


def _signal_live(procs: Sequence[subprocess.Popen], send: Callable[[subprocess.Popen], None]) -> None:
    for proc in procs:
        if proc.poll() is None:
            try:
                send(proc)
            except OSError:
                pass  # it exited in between


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = 5.0) -> list[int | None]:
    """SIGTERM every live process at once, SIGKILL what is left after `timeout_s`, reap all.
    Returns the exit codes (None only for a process that survived SIGKILL's wait)."""
    _signal_live(procs, subprocess.Popen.terminate)
    wait_all(procs, Deadline(timeout_s))
    _signal_live(procs, subprocess.Popen.kill)
    wait_all(procs, Deadline(max(timeout_s, 5.0)))
    return [proc.returncode for proc in procs]


def wait_all(procs: Sequence[subprocess.Popen], deadline: Deadline) -> None:
    """Reap what exits before `deadline`; the rest are left running (the caller escalates)."""
    for proc in procs:
        try:
            proc.wait(timeout=deadline.remaining_s())
        except subprocess.TimeoutExpired:
            pass


class SpawnerThread:
    """A thread that starts child processes on request and then idles until `release()`.

    Children that arm PR_SET_PDEATHSIG (see `exit_with_parent`) are signalled when the thread
    that forked them ends; with every fork done here, that is when the whole process dies or
    when `release()` is called (after the children were stopped), whichever thread created
    or uses this object."""

    def __init__(self, name: str = "tidal-spawner") -> None:
        self._jobs: "queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            fn, result = job
            try:
                result.set_result(fn())
            except BaseException as e:  # noqa: BLE001 - handed back to the caller
                result.set_exception(e)

    def call(self, fn: Callable[[], Any], timeout_s: float | None = None,
             on_late: Callable[[Any], None] | None = None) -> Any:
        """Run `fn` (e.g. a subprocess.Popen) on the spawner thread and return its result.
        After `timeout_s`, TimeoutError; a result that comes after that goes to `on_late`
        (stop the process it started, say) instead of being dropped."""
        if not self._thread.is_alive():
            raise RuntimeError("spawner thread was released")
        result: Future[Any] = Future()
        self._jobs.put((fn, result))
        try:
            return result.result(timeout_s)
        except FutureTimeout:  # not the builtin TimeoutError before Python 3.11
            if on_late is not None:  # runs now if the result came meanwhile (the Future's lock)
                result.add_done_callback(lambda f: f.exception() is None and on_late(f.result()))
            raise TimeoutError(f"the spawner thread did not finish within {timeout_s} s") from None

    def release(self) -> None:
        """End the thread (idempotent); children still alive get their parent-death signal."""
        if self._thread.is_alive():
            self._jobs.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join(timeout=5.0)
