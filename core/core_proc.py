"""The engine-core process: EngineCore in a busy loop behind one ZMQ ROUTER socket.

Started by a front-end (`python -m tidal.core.core_proc --address ipc://... --config-json ...`,
see frontend/core_process.py) or headless by an operator (`tidal core MODEL --address tcp://...`);
both run `run_engine_core`. Front-ends connect DEALER sockets with unique identities; a request
is stamped with its sender's identity (`Request.client_index`), and its outputs go back there.

Busy loop (main thread): block on the input queue only when there is no work (with a timeout,
to check the executor's health), drain the queue, step, send each front-end its share of the
step's outputs. The engine drains the queue again between the forward pass and building the
outputs (`EngineCore.apply_input`), so aborts that arrived during the step are applied before
its outputs exist.

Handshake: a front-end's first call is the utility HELLO, answered with the core's
ResolvedEngineInfo; a core that fails to start answers it (and writes `--error-file`) with its
error text. Death: an exception in the loop sends `engine_dead` to every front-end, naming its
requests that were in the step that failed (`failed_step_request_ids`: the suspects it
quarantines), and exits non-zero; SIGTERM/SIGINT shut down cleanly; a spawned core exits when
its parent dies (PR_SET_PDEATHSIG plus a parent-pid poll in a watchdog thread). A headless core drains on
SIGTERM first (core/drain.py): no new requests, the ones in flight finish (bounded), then the
same clean shutdown. A spawned core obeys the SIGTERM/SIGINT its front-end sends; the first
one from anyone else while the front-end lives is the whole process group's (`timeout`,
systemd, Ctrl-C): the front-end got it too and is draining its streams, so the core keeps
serving them until the front-end stops it (a second such signal stops it at once). A keyed
core (`key_file`) serves only front-ends holding its CURVE key (tidal_pkg/utils/curve.py).
"""
from __future__ import annotations

import _thread
import argparse
import gc
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from typing import Any

import msgspec

from tidal.core.core_io import GONE, CoreIO, InputItem
from tidal.core.drain import Drain
from tidal.protocol.config import EngineConfig
from tidal.protocol.messages import (
    HELLO,
    EngineCoreOutputs,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
    encode_utility_result,
)
from tidal.utils.logging_utils import setup_logging, summarize_exception
from tidal.utils.openmp import take_data_parallel_share
from tidal.utils.process import GROUP_SIGNALS, exit_with_parent, unblock_group_signals, watch_signals

logger = logging.getLogger("tidal.core.core_proc")

_IDLE_POLL_S = 0.5  # longest block on the input queue before a health check
_PARENT_POLL_S = 0.5
_PARENT_GONE_EXIT_S = 10.0  # a clean exit after the parent died may take this long, no more
_ADD, _ABORT, _UTILITY = (t.value for t in EngineCoreRequestType)


_WAKE = b"wake"  # (_WAKE, b"", None): put by the signal handler to end an idle wait at once


class _Shutdown(BaseException):
    """Leave the loop and shut down cleanly. Raised by the busy loop itself once a stop was
    asked for (between steps, never inside one), or by the signal handler only while the
    engine is still starting or when a second signal comes (the loop is stuck in one step).
    A BaseException so that no `except Exception` inside engine code swallows it."""


class EngineCoreProc:
    def __init__(self, config: EngineConfig, address: str, *, error_file: str | None = None,
                 freeze_gc: bool = False, key_file: str | None = None, drain: Drain | None = None) -> None:
        """freeze_gc: no automatic GC while the engine starts, gc.freeze() once it is up and has
        answered its first input (only when this process is the core).
        key_file: CURVE key file (required to bind off loopback). drain: SIGTERM drains first."""
        self.config = config
        self.drain = drain
        self.freeze_gc = freeze_gc
        if freeze_gc:
            # Start-up allocates ~10^5 long-lived objects (torch, the model, a block per KV
            # block); each burst set off full collections over everything so far (~0.1 s) for
            # nothing: they all live as long as the process. _freeze_gc turns it back on.
            gc.disable()
        self.error_file = error_file
        self.input_queue: "queue.SimpleQueue[InputItem]" = queue.SimpleQueue()
        self.engine: Any = None  # EngineCore once started
        self._clients: set[bytes] = set()  # connected identities: each hears engine_dead
        self._shutting_down = False
        self.stop_requested: str | None = None  # a signal's name, set by the handler
        # Bind first: a bad address fails at once.
        self.io = CoreIO(address, self.input_queue, heartbeat_timeout_s=config.heartbeat_timeout_s,
                         key_file=key_file)

    # ------------------------------------------------------------------ lifecycle
    def run(self) -> int:
        """Start the engine, serve until told to stop; returns the process exit code."""
        try:
            from tidal.core.engine_core import EngineCore

            self.engine = EngineCore(self.config, apply_input=self._drain, announce=self._announce)
        except _Shutdown:
            self.io.close()
            return 0
        except BaseException as e:
            logger.exception("engine core failed to start")
            self._fail_start(f"{type(e).__name__}: {e}")
            return 1
        logger.info("engine core ready at %s: %s", self.io.address, self.engine.info)
        code, dead_msg = 0, "engine core shut down"
        # The requests of the step that failed, by front-end (None: unknown); a core stopped on
        # purpose failed in no step.
        failed: dict[Any, list[str]] | None = {}
        try:
            self._busy_loop()
            if self.drain is not None:
                dead_msg = self.drain.reason
        except _Shutdown as e:
            dead_msg = f"engine core shut down ({e})"
        except BaseException as e:
            logger.exception("engine core busy loop failed")
            code, dead_msg = 1, summarize_exception(e)
            failed = self.engine.failed_step_request_ids()
        self._shutting_down = True
        # Whatever the reason, every front-end learns it now instead of waiting on a timeout,
        # with its requests that were in the failing step (the suspects it quarantines).
        for identity in self._clients:
            self.io.send(identity, EngineCoreOutputs(
                engine_dead=dead_msg, failed_step_request_ids=None if failed is None else failed.get(identity, [])))
        try:
            self.engine.shutdown()
        finally:
            self.io.close()
        return code

    def _fail_start(self, error: str) -> None:
        if self.error_file:
            tmp = self.error_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(error)
            os.replace(tmp, self.error_file)  # the front-end never reads a half-written file
        while True:  # answer the handshakes that already arrived
            try:
                kind, identity, item = self.input_queue.get_nowait()
            except queue.Empty:
                break
            if kind == _UTILITY:
                self._reply(identity, item.call_id, failure=error)
        self.io.close()

    # ------------------------------------------------------------------ busy loop
    def _busy_loop(self) -> None:
        """Returns only when a drain is done; every other way out is an exception."""
        engine, drain = self.engine, self.drain
        while True:
            if self.stop_requested is not None:
                raise _Shutdown(self.stop_requested)
            if drain is not None and drain.should_stop(engine):
                return
            if not engine.has_unfinished_requests() and not self._wait_for_input():
                continue
            self._drain()
            self._step()

    def request_stop(self, reason: str) -> None:
        """From the signal handler: stop between steps. Raising there instead could unwind
        the main thread from anywhere -- inside a lock (logging's, a queue's), halfway
        through a step with workers waiting on it -- and the clean shutdown then hung. The
        wake item ends an idle wait now (SimpleQueue.put is safe to call from a handler)."""
        self.stop_requested = reason
        self.input_queue.put((_WAKE, b"", None))

    # Inputs and outputs are handled in helpers of their own, never in _busy_loop's frame: a
    # loop variable would keep the last request (up to MAX_MESSAGE_BYTES decoded) or the last
    # step's outputs alive while the loop waits, possibly for good.
    def _wait_for_input(self) -> bool:
        """Idle: block until one input arrives and handle it (True), or check health (False)."""
        try:
            item = self.input_queue.get(timeout=_IDLE_POLL_S)
        except queue.Empty:
            self.engine.check_health()
            return False
        if item[0] == _WAKE:
            return False
        self._handle(item)
        if self.freeze_gc:
            self._freeze_gc()
        return True

    def _freeze_gc(self) -> None:
        """Everything allocated at start-up (torch, the model, the block pool) lives as long as
        the process: keep it out of every future GC pass, which would otherwise walk it again
        and again and cost the busy loop milliseconds per step (vLLM's core does the same).
        Done after the first input (the front-end's handshake), with no collect first: one
        finds ~10 cyclic objects among ~170,000 and holds the GIL for ~0.1 s -- long enough to
        keep the IO thread from sending the handshake's answer, so every `LLM()` waited for it.
        Automatic GC was off since start-up (see __init__); it is back on from here."""
        self.freeze_gc = False
        gc.freeze()
        gc.enable()

    def _step(self) -> None:
        self._send_all(self.engine.step())

    def _send_all(self, outputs_by_client: dict[Any, EngineCoreOutputs]) -> None:
        for identity, outputs in outputs_by_client.items():
            self.io.send(identity, outputs)

    def _announce(self, outputs_by_client: dict[Any, EngineCoreOutputs]) -> None:
        """Requests about to run their first step: on the wire before the step starts, so the
        front-end knows they ran even if this process is killed during it (a flush costs a
        thread hand-off, once per step that starts requests)."""
        self._send_all(outputs_by_client)
        self.io.flush()

    def _drain(self) -> None:
        """Apply everything on the input queue (also called by the engine mid-step)."""
        in_q = self.input_queue
        while True:
            try:
                item = in_q.get_nowait()
            except queue.Empty:
                return
            self._handle(item)

    def _handle(self, item: InputItem) -> None:
        kind, identity, payload = item
        if kind == _ADD:
            self._clients.add(identity)
            self.engine.add_request(payload, identity)
        elif kind == _ABORT:
            self.engine.abort_requests(payload, identity)
        elif kind == _UTILITY:
            self._clients.add(identity)
            self._utility(identity, payload)
        elif kind == GONE:
            # Its connection is gone: nobody will read these requests' outputs; free their KV.
            n = self.engine.drop_client(identity)
            if n:
                logger.info("front-end %s disconnected; aborted its %d request(s)", identity.hex()[:16], n)
            self._clients.discard(identity)
        elif kind == _WAKE:
            pass  # the busy loop sees the stop request at its next iteration
        else:
            raise RuntimeError(str(payload))  # the IO thread died

    def _utility(self, identity: bytes, req: UtilityRequest) -> None:
        try:
            if req.method == HELLO:
                result: object = self.engine.info
            else:
                result = self.engine.call_utility(req.method, list(req.args))
            # Encoded here, so that a result that cannot be encoded fails this call alone.
            encoded = encode_utility_result(result)
        except Exception as e:
            self._reply(identity, req.call_id, failure=f"{type(e).__name__}: {e}")
            return
        self._reply(identity, req.call_id, encoded)

    def _reply(self, identity: bytes, call_id: int, result: msgspec.Raw | None = None,
               failure: str | None = None) -> None:
        out = UtilityOutput(call_id, failure=failure) if result is None else UtilityOutput(call_id, result, failure)
        self.io.send(identity, EngineCoreOutputs(utility_output=out, timestamp=time.monotonic()))


def _watch_parent(parent_pid: int) -> None:
    """Exit when the front-end process is gone: PR_SET_PDEATHSIG (as SIGUSR1, see the handler)
    for immediacy, plus this thread's parent-pid poll, which also covers a main thread stuck
    in a long C call (it releases the GIL) and escalates to os._exit if a clean exit stalls."""

    def run() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        _thread.interrupt_main(signal.SIGTERM)  # the clean path first
        time.sleep(_PARENT_GONE_EXIT_S)
        os._exit(1)

    threading.Thread(target=run, name="tidal-core-parent-watch", daemon=True).start()
    exit_with_parent(signal.SIGUSR1)


class _GroupSignalFilter:
    """A spawned core's SIGTERM/SIGINT by sender (tidal_pkg/utils/process.py's watch_signals). Its
    front-end's, or any once the front-end is gone, go on to `on_stop` in the main thread as
    if delivered there. The first from anyone else while the front-end lives is taken for the
    process group's shutdown signal, which the front-end got too: it drains its streams, which
    need this core, then stops it; so that one is only logged. Runs in the signal thread."""

    def __init__(self, proc_ref: list[EngineCoreProc | None], parent_pid: int) -> None:
        self.proc_ref = proc_ref
        self.parent_pid = parent_pid
        self.deferred: str | None = None  # the group's signal, once one came

    def __call__(self, signum: int, sender: int) -> None:
        name = signal.Signals(signum).name
        if sender != self.parent_pid and os.getppid() == self.parent_pid and self.deferred is None:
            self.deferred = name
            logger.info("%s from pid %d, not from this core's front-end (pid %d): taken for the process "
                        "group's shutdown; serving the requests in flight until the front-end stops this "
                        "core (another such signal stops it now)", name, sender, self.parent_pid)
            return
        _thread.interrupt_main(signum)  # on_stop runs in the main thread at its next bytecode
        proc = self.proc_ref[0]
        if proc is not None:
            proc.input_queue.put((_WAKE, b"", None))  # ...which an idle wait must not delay


def _install_signal_handlers(proc_ref: list[EngineCoreProc | None], parent_pid: int | None) -> None:
    def on_stop(signum: int, _frame: Any) -> None:
        proc = proc_ref[0]
        if proc is not None and proc._shutting_down:
            return  # already on the way out: let the shutdown finish
        drain = None if proc is None or proc.engine is None else proc.drain
        if signum == signal.SIGTERM and drain is not None and not drain.requested:
            drain.request()  # the busy loop drains, then shuts down; a second SIGTERM is at once
            return
        name = signal.Signals(signum).name
        if proc is None or proc.engine is None or proc.stop_requested is not None:
            # Starting (nothing in flight to protect), or a second signal: the loop did not
            # get back to its check, so one step is stuck; leave from wherever it is.
            raise _Shutdown(name)
        proc.request_stop(name)

    def on_parent_signal(signum: int, _frame: Any) -> None:
        # PDEATHSIG also fires when the *thread* that spawned us exits while its process lives
        # on; only a changed parent pid means the front-end process itself is gone.
        if parent_pid is not None and os.getppid() != parent_pid:
            on_stop(signum, _frame)

    if parent_pid is None:
        unblock_group_signals()  # standalone: they stop it, whoever started it (it may pass them on blocked)
    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    if parent_pid is not None:
        # The front-end started this process with them blocked (tidal_pkg/utils/process.py); the
        # watcher starts after on_stop is in place, which the filter hands signals on to.
        watch_signals(GROUP_SIGNALS, _GroupSignalFilter(proc_ref, parent_pid), "tidal-core-signals")
        signal.signal(signal.SIGUSR1, on_parent_signal)
        _watch_parent(parent_pid)


def run_engine_core(config: EngineConfig, address: str, *, parent_pid: int | None = None,
                    error_file: str | None = None, key_file: str | None = None,
                    drain_timeout_s: float | None = None) -> int:
    """Serve `config` at `address` in this process until stopped; returns the exit code.
    drain_timeout_s: drain on SIGTERM for up to this long (headless cores; None: no drain)."""
    proc_ref: list[EngineCoreProc | None] = [None]
    drain = None if drain_timeout_s is None else Drain(drain_timeout_s)
    try:
        _install_signal_handlers(proc_ref, parent_pid)  # exits at once if the parent is gone
        proc_ref[0] = proc = EngineCoreProc(config, address, error_file=error_file, freeze_gc=True,
                                            key_file=key_file, drain=drain)
        return proc.run()
    except _Shutdown:
        return 0


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="tidal engine-core process (spawned by a front-end)")
    parser.add_argument("--address", required=True)
    parser.add_argument("--config-json", required=True, help="EngineConfig.to_json()")
    parser.add_argument("--parent-pid", type=int, default=None)
    parser.add_argument("--error-file", default=None, help="where to write the start-up error")
    parser.add_argument("--cleanup-dir", default=None, help="directory to remove on exit")
    parser.add_argument("--key-file", default=None, help="CURVE key file (tidal_pkg/utils/curve.py)")
    parser.add_argument("--drain-timeout-s", type=float, default=None,
                        help="on SIGTERM, finish in-flight requests for up to this long first")
    args = parser.parse_args(argv)
    setup_logging("engine-core")
    code = 1
    try:
        config = EngineConfig.from_json(args.config_json)
        if config.dp_local_size > 1 and config.device != "cuda":
            # Before torch starts a thread: every later thread and worker inherits the share.
            take_data_parallel_share(config.dp_local_index, config.dp_local_size)
        code = run_engine_core(config, args.address,
                               parent_pid=args.parent_pid, error_file=args.error_file,
                               key_file=args.key_file, drain_timeout_s=args.drain_timeout_s)
    except Exception as e:  # e.g. the address cannot be bound
        logger.exception("engine core failed")
        if args.error_file:
            with open(args.error_file, "w") as f:
                f.write(f"{type(e).__name__}: {e}")
    finally:
        # A front-end that was SIGKILLed cannot remove its ipc directory; its core does.
        if args.cleanup_dir and args.parent_pid is not None and os.getppid() != args.parent_pid:
            shutil.rmtree(args.cleanup_dir, ignore_errors=True)
    sys.exit(code)


if __name__ == "__main__":
    main()
