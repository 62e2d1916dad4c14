"""Starting, watching and stopping the engine-core process a front-end owns.

`CoreProcess` spawns `python -m tidal.core.core_proc` (only strings on its command line: the
config travels as JSON, no pickle) bound to an ipc socket inside a private 0700 directory that
`shutdown()` removes. `CoreWatcher` is a thread that reports, once, that the core is gone: its
process exited (pidfd, or a poll) or, for any core, the DEALER's connection dropped (a ZMQ
socket monitor) -- so a SIGKILLed core becomes EngineDeadError within a fraction of a second.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import weakref
from typing import Callable

import zmq

from tidal.frontend.priority import popen
from tidal.protocol.config import EngineConfig
from tidal.utils.openmp import compute_process_env
from tidal.utils.process import group_signals_blocked, stop_process
from tidal.utils.zmq_utils import IpcDir

logger = logging.getLogger(__name__)

_TERM_GRACE_S = 5.0  # SIGTERM first (the core tells its front-ends, stops its workers), then SIGKILL
_REASON_GRACE_S = 0.3  # see CoreWatcher._run


def _stop_process(proc: subprocess.Popen, ipc_dir: IpcDir, grace_s: float, stopping: threading.Event) -> None:
    """SIGTERM (the core tells its front-ends and stops its workers), SIGKILL after grace_s.
    `stopping` is set first: the watcher then knows the core's end is no death to report."""
    stopping.set()
    alive = proc.poll() is None  # else it ended by itself, and whatever that was got reported
    try:
        code = stop_process(proc, grace_s)
    finally:
        ipc_dir.cleanup()
    if alive and code != 0:  # a core stopped by its front-end shuts down cleanly: exit code 0
        logger.warning("the engine core (pid %d) exited with code %s when stopped", proc.pid, code)


class CoreProcess:
    """An engine-core process spawned by this front-end, serving at `self.address` (ipc)."""

    # What follows the interpreter on the command line; tests swap in a script that runs the
    # same core with a fault injected, so the production path carries no test branch.
    core_entry: tuple[str, ...] = ("-m", "tidal.core.core_proc")

    def __init__(self, config: EngineConfig) -> None:
        self.ipc_dir = IpcDir()
        self.address = self.ipc_dir.address("core")
        self.error_file = os.path.join(self.ipc_dir.path, "start-error")
        cmd = [
            sys.executable, *self.core_entry,
            "--address", self.address,
            "--config-json", config.to_json().decode(),
            "--parent-pid", str(os.getpid()),
            "--error-file", self.error_file,
            "--cleanup-dir", self.ipc_dir.path,
        ]
        try:
            # At the process's own priority even when the server's loop runs nicer (priority.py),
            # and with the process group's SIGTERM/SIGINT blocked from its first instruction:
            # the core tells its front-end's signals from the group's (core/core_proc.py).
            with group_signals_blocked():
                self.proc = popen(cmd, stdin=subprocess.DEVNULL, close_fds=True, env=compute_process_env())
        except BaseException:
            self.ipc_dir.cleanup()
            raise
        # Set once this process stops the core on purpose (a script that ends without shutdown()
        # has it stopped at interpreter exit): not a death, so nothing is logged or restarted.
        self.stopping = threading.Event()
        # Runs at shutdown(), at garbage collection, or at interpreter exit, whichever is first.
        self._finalizer = weakref.finalize(self, _stop_process, self.proc, self.ipc_dir, _TERM_GRACE_S,
                                           self.stopping)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def startup_error(self) -> str:
        """Why a core that exited during start-up failed, in its own words when it wrote them."""
        try:
            with open(self.error_file) as f:
                text = f.read().strip()
            if text:
                return text
        except OSError:
            pass
        return f"the engine-core process exited with code {self.proc.poll()} (see its log above)"

    def shutdown(self, grace_s: float = _TERM_GRACE_S) -> None:
        if self._finalizer.alive:
            self._finalizer.detach()
            _stop_process(self.proc, self.ipc_dir, grace_s, self.stopping)


class CoreWatcher:
    """Calls `on_dead(reason)` once from its own thread when the core is gone."""

    def __init__(self, ctx: zmq.Context, monitored: zmq.Socket, process: CoreProcess | None,
                 on_dead: Callable[[str], None]) -> None:
        self._process = process
        self._on_dead = on_dead
        self._stop_r, self._stop_w = os.pipe()
        self._stopped = threading.Event()
        # The monitor's PAIR is created and connected here, before the thread starts (a full
        # memory barrier, so handing the socket to the thread is allowed); from then on only
        # the thread touches it.
        addr = f"inproc://tidal-core-monitor-{id(self):x}"
        monitored.monitor(addr, zmq.EVENT_DISCONNECTED)
        # A plain (blocking) socket even when `ctx` is a zmq.asyncio context: same libzmq
        # context underneath, so the inproc address is reachable.
        self._mon: zmq.Socket = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self._mon.setsockopt(zmq.LINGER, 0)
        self._mon.connect(addr)
        self._pidfd = -1
        if process is not None and hasattr(os, "pidfd_open"):
            try:
                self._pidfd = os.pidfd_open(process.pid)
            except OSError:
                self._pidfd = -1  # old kernel: fall back to polling the process
        self._thread = threading.Thread(target=self._run, name="tidal-core-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._mon, zmq.POLLIN)
        poller.register(self._stop_r, zmq.POLLIN)
        if self._pidfd >= 0:
            poller.register(self._pidfd, zmq.POLLIN)
        # Without a pidfd the process is polled: every 100 ms bounds the detection delay.
        timeout_ms = None if self._process is None or self._pidfd >= 0 else 100
        reason = None
        # The monitor's reader stays open after a death (stop() closes it): libzmq sends monitor
        # events with a blocking send from its IO thread, and an event for a reader that is
        # gone would block that thread -- every socket of the context -- for good. The owner
        # disables the monitor before it stops the watcher (core_connection._close_socket).
        while reason is None:
            ready = dict(poller.poll(timeout_ms))
            if self._stop_r in ready:
                return
            if self._process is not None and (rc := self._process.poll()) is not None:
                reason = f"the engine-core process exited unexpectedly (exit code {rc})"
            elif self._mon in ready:
                self._mon.recv_multipart()
                reason = "lost the connection to the engine core"
        # A core that dies on purpose (exception, SIGTERM) sends `engine_dead` with its reason
        # just before it goes; give the reader a moment to report that one first (on_dead is
        # idempotent, so whichever comes second is a no-op).
        if not self._stopped.wait(_REASON_GRACE_S) and not self._stopping():
            logger.error("engine core is dead: %s", reason)
            self._on_dead(reason)

    def _stopping(self) -> bool:
        """This process is stopping the core itself (see CoreProcess.stopping)."""
        return self._process is not None and self._process.stopping.is_set()

    def stop(self) -> None:
        """Stop watching (before an intended shutdown, so that it is not reported as a death)."""
        if self._stop_w < 0:
            return
        self._stopped.set()
        os.write(self._stop_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(2.0)
        if not self._thread.is_alive() or threading.current_thread() is self._thread:
            self._mon.close(linger=0)  # the thread is done with it (joined, or it is this thread)
        os.close(self._stop_w)
        os.close(self._stop_r)
        self._stop_w = self._stop_r = -1
        if self._pidfd >= 0:
            os.close(self._pidfd)
            self._pidfd = -1
