"""A tensor-parallel worker process: one per rank, driven by the core's MultiprocExecutor.

Started as `python -m tidal.worker.worker_proc` with JSON arguments (no pickle anywhere). It
receives each step's SchedulerOutput on its own socket, runs it, and rank 0 sends the
ModelRunnerOutput back; any rank reports its own failure on the same result socket (flagged
when it was raised inside a collective, i.e. most likely a peer's failure seen from here).

Lifetime: PR_SET_PDEATHSIG(SIGKILL) ends the process when the core dies, even while it is
blocked inside a gloo/NCCL collective (the executor forks workers from a thread that lives as
long as they should, see tidal_pkg/utils/process.py); a parent-pid poll covers the window before the
prctl and other platforms. The core owns shutdown (SHUTDOWN message, then SIGTERM/SIGKILL):
a SIGTERM or SIGINT from anyone else -- the whole process group's, at its shutdown (`timeout`,
systemd, Ctrl-C) -- is logged and ignored, so a rank never dies under a core that is still
finishing the requests in flight (tidal_pkg/utils/process.py's watch_signals tells the sender).
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import EngineConfig
from tidal.protocol.messages import SchedulerOutput, WorkerFrame
from tidal.utils.logging_utils import format_frames, setup_logging, summarize_exception
from tidal.utils.process import GROUP_SIGNALS, end_by_signal, exit_with_parent, watch_signals

logger = logging.getLogger("tidal.worker")

STEP, SHUTDOWN = WorkerFrame.STEP, WorkerFrame.SHUTDOWN
READY, OUTPUT, FAILED = WorkerFrame.READY, WorkerFrame.OUTPUT, WorkerFrame.FAILED
IN_COLLECTIVE, WHERE = WorkerFrame.IN_COLLECTIVE, WorkerFrame.WHERE

_POLL_MS = 500


def _in_collective(frames: list[traceback.FrameSummary]) -> bool:
    return any(os.path.join("torch", "distributed") in f.filename for f in frames)


class _State:
    busy_step = 0  # the step this rank is executing; 0 while it waits for one


def _start_probe_thread(probe_address: str, result_address: str, rank: int) -> None:
    """Answer the core's "where are you?" (sent when a step times out) from a thread of our
    own: the main thread may be stuck, in a collective (which releases the GIL) or elsewhere.
    Own context, never torn down (the process ends with os._exit)."""
    main_ident = threading.main_thread().ident
    ctx = zmq.Context()

    def run() -> None:
        probe = ctx.socket(zmq.PULL)
        probe.connect(probe_address)
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 0)
        out.connect(result_address)
        while True:
            probe.recv()
            frame = sys._current_frames().get(main_ident)  # noqa: SLF001 - a stack snapshot
            stack = traceback.extract_stack(frame) if frame is not None else []
            out.send_multipart([WHERE, str(rank).encode(), str(_State.busy_step).encode(),
                                format_frames(stack[-4:]).encode(), IN_COLLECTIVE if _in_collective(stack) else b""])

    threading.Thread(target=run, name="tidal-worker-probe", daemon=True).start()


def _obey_only_the_core(rank: int, core_pid: int) -> None:
    """SIGTERM/SIGINT end this rank only when its core sent them (or the core is gone): the
    group's signal reaches the core too, which finishes its steps and then stops its workers.
    Before any other thread starts (see watch_signals)."""

    def on_signal(signum: int, sender: int) -> None:  # in the signal thread
        if sender == core_pid or os.getppid() != core_pid:
            end_by_signal(signum)
        logger.info("worker rank %d: %s from pid %d ignored: its engine core (pid %d) stops it",
                    rank, signal.Signals(signum).name, sender, core_pid)

    if not watch_signals(GROUP_SIGNALS, on_signal, "tidal-worker-signals"):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # no sender to tell: at least not Ctrl-C


def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str,
               step_address: str, result_address: str, probe_address: str,
               listen_fd: int | None = None) -> int:
    parent = exit_with_parent(signal.SIGKILL)
    _obey_only_the_core(rank, parent.parent_pid)  # first: no other thread exists yet
    _start_probe_thread(probe_address, result_address, rank)
    ctx = zmq.Context()
    steps = ctx.socket(zmq.PULL)
    steps.setsockopt(zmq.LINGER, 0)
    steps.connect(step_address)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)  # a FAILED report must get out before we exit
    results.connect(result_address)
    me = str(rank).encode()
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(SchedulerOutput)
    try:
        from tidal.worker.worker import Worker

        t0 = time.perf_counter()
        worker = Worker(config, rank, world_size, init_method, listen_fd)
        info = worker.initialize()
        logger.info("worker rank %d ready in %.2fs", rank, time.perf_counter() - t0)
        results.send_multipart([READY, me, *encoder.encode(info)])
        num_steps = 0
        while True:
            if not steps.poll(_POLL_MS):
                if not parent.alive():
                    return 1
                continue
            frames = steps.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == SHUTDOWN:
                worker.shutdown()
                return 0
            if kind != STEP:
                logger.warning("worker %d: dropping unknown message kind %r", rank, kind)
                continue
            num_steps += 1
            _State.busy_step = num_steps
            out = worker.execute_model(decoder.decode([f.buffer for f in frames[1:]]))
            if out is not None:
                results.send_multipart([OUTPUT, me, *encoder.encode(out)], copy=False)
            _State.busy_step = 0
    except BaseException as e:  # noqa: BLE001 - every failure must reach the core, named
        logger.error("worker rank %d failed", rank, exc_info=True)
        frames = [FAILED, me, summarize_exception(e).encode(errors="replace")]
        if _in_collective(traceback.extract_tb(e.__traceback__)):
            frames.append(IN_COLLECTIVE)
        try:
            results.send_multipart(frames)
        except zmq.ZMQError:
            pass
        # No process-group teardown: it may wait on a dead peer.
        return 1
    finally:
        ctx.destroy(linger=2000)  # flushes a FAILED report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="tidal tensor-parallel worker (started by the engine core)")
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--listen-fd", type=int, default=None, help="rank 0: bound rendezvous socket")
    ap.add_argument("--step-address", required=True)
    ap.add_argument("--result-address", required=True)
    ap.add_argument("--probe-address", required=True)
    a = ap.parse_args(argv)
    setup_logging(f"worker rank{a.rank}")
    code = run_worker(EngineConfig.from_json(a.config_json), a.rank, a.world_size, a.init_method,
                      a.step_address, a.result_address, a.probe_address, a.listen_fd)
    # Skip interpreter teardown (torch/gloo destructors, the probe thread): nothing is left to
    # flush but the standard streams, and a failed rank must not wait on a dead peer.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
