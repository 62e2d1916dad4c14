"""Process helpers every tidal child uses: die with the parent, reap children, and tell a
signal from the owner apart from one sent to the whole process group.

Parent death on Linux is PR_SET_PDEATHSIG, which the kernel ties to the *thread* that forked
the child, not to its process: a child spawned from a short-lived thread would be signalled
when that thread ends. `SpawnerThread` owns the fork for that reason: it lives exactly as long
as its children should, so the signal fires when the parent process dies (or the spawner is
released) and never because some unrelated thread returned.

A child started by a tidal process shares its process group, so the SIGTERM or SIGINT that
`timeout`, systemd (KillMode=control-group signals every process of the unit) or a terminal's
Ctrl-C sends reaches the child at the same moment as its owner. The owner then shuts down, and
stops the child itself once the work in flight is done; the child must not die under it
meanwhile. So every tidal child is born with those signals blocked (`SpawnerThread` forks with
them blocked, `group_signals_blocked` around any other fork; the mask passes through fork and
exec to every thread the child will have, also those a library starts at import), and then
decides: `watch_signals` receives them with their sender's pid (siginfo), so a child can obey
its owner and leave the group's signal to the owner; a child that wants them as usual
unblocks them (`unblock_group_signals`).
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Iterator, Sequence

from tidal.utils.deadline import Deadline

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
GROUP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what a process group gets at its shutdown


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
    if stuck := [proc.pid for proc in procs if proc.poll() is None]:
        logger.warning("process(es) %s did not exit within %gs of SIGTERM: killing them", stuck, timeout_s)
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
        # Every child forked here starts with the group's shutdown signals blocked (see the
        # module's docstring); this thread itself never needs them (Python runs handlers in
        # the main thread), so the process goes on receiving them as before.
        signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
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


@contextlib.contextmanager
def group_signals_blocked() -> Iterator[None]:
    """GROUP_SIGNALS blocked in the calling thread meanwhile, so that a child forked here is
    born with them blocked. One that comes meanwhile is not lost: another thread takes it, or
    it waits, pending, until the end."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock_group_signals() -> None:
    """Take GROUP_SIGNALS as usual again (handlers, default actions) in a process that may have
    been born with them blocked: unblocked in the main thread, which the kernel then prefers
    for them (threads started earlier keep them blocked, and so stay out of the way)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)


def watch_signals(signals: Sequence[int], on_signal: Callable[[int, int], None],
                  name: str = "tidal-signals") -> bool:
    """Receive `signals` in a thread of their own with the pid of their sender (siginfo's
    si_pid: 0 when the kernel sent it, e.g. for a terminal's Ctrl-C): that thread calls
    `on_signal(signum, sender_pid)` for each, one at a time. Returns False where the platform
    cannot tell the sender (no sigwaitinfo): the signals are then unblocked, for the caller's
    handlers or their default actions as usual.

    The signals must be blocked in every thread of the process, else a thread that has them
    unblocked takes them by its handler: call this from the main thread before any other
    thread starts (it blocks them there, and later threads inherit the mask), or in a process
    born with them blocked (see the module's docstring). A signal that came before the
    watcher started waits, pending, and is the watcher's first."""
    if not hasattr(signal, "sigwaitinfo"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)
        return False
    wanted = set(signals)
    signal.pthread_sigmask(signal.SIG_BLOCK, wanted)

    def run() -> None:
        while True:
            info = signal.sigwaitinfo(wanted)
            on_signal(info.si_signo, info.si_pid)

    threading.Thread(target=run, name=name, daemon=True).start()
    return True


def end_by_signal(signum: int) -> None:
    """End this process the way `signum` does by default (its exit status says so), from any
    thread, also while the signal is blocked (see watch_signals). Never returns."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signum})  # in the calling thread only
    if signal.getsignal(signum) is signal.SIG_DFL:
        signal.raise_signal(signum)  # directed at this thread, where it is unblocked: the default action
    os._exit(128 + signum)  # a handler or SIG_IGN stood in the way: the shell's convention
