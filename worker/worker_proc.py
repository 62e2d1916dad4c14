"""A tensor-parallel worker process: one per rank, driven by the core's MultiprocExecutor.

Started as `python -m tidal.worker.worker_proc` with JSON arguments (no pickle anywhere). It
receives each step's SchedulerOutput on its own socket, runs it, and rank 0 sends the
ModelRunnerOutput back; any rank reports its own failure on the same result socket. It exits
when the core dies (parent-death signal plus a parent poll) or on a SHUTDOWN message.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import traceback

import zmq

from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import EngineConfig
from tidal.protocol.messages import SchedulerOutput, WorkerFrame
from tidal.protocol.process import exit_with_parent

logger = logging.getLogger("tidal.worker")

STEP, SHUTDOWN = WorkerFrame.STEP, WorkerFrame.SHUTDOWN
READY, OUTPUT, FAILED = WorkerFrame.READY, WorkerFrame.OUTPUT, WorkerFrame.FAILED

_POLL_MS = 500


def run_worker(config: EngineConfig, rank: int, world_size: int, init_method: str,
               step_address: str, result_address: str) -> int:
    parent = exit_with_parent()
    ctx = zmq.Context()
    steps = ctx.socket(zmq.PULL)
    steps.setsockopt(zmq.LINGER, 0)
    steps.connect(step_address)
    results = ctx.socket(zmq.PUSH)
    results.setsockopt(zmq.LINGER, 2000)
    results.connect(result_address)
    me = str(rank).encode()
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(SchedulerOutput)
    worker = None
    try:
        from tidal.worker.worker import Worker

        worker = Worker(config, rank, world_size, init_method)
        info = worker.initialize()
        results.send_multipart([READY, me, *encoder.encode(info)])
        while True:
            if not steps.poll(_POLL_MS):
                if not parent.alive():
                    return 1
                continue
            frames = steps.recv_multipart(copy=False)
            kind = frames[0].bytes
            if kind == SHUTDOWN:
                return 0
            if kind != STEP:
                logger.warning("worker %d: dropping unknown message kind %r", rank, kind)
                continue
            out = worker.execute_model(decoder.decode([f.buffer for f in frames[1:]]))
            if out is not None:
                results.send_multipart([OUTPUT, me, *encoder.encode(out)], copy=False)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the core, named
        tb = traceback.format_exc(limit=8)
        logger.error("worker rank %d failed: %s", rank, tb)
        try:
            results.send_multipart([FAILED, me, f"{type(e).__name__}: {e}\n{tb}".encode()])
        except zmq.ZMQError:
            pass
        return 1
    finally:
        if worker is not None:
            try:
                worker.shutdown()
            except Exception:  # noqa: BLE001 - already exiting
                pass
        ctx.destroy(linger=2000)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config-json", required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world-size", type=int, required=True)
    ap.add_argument("--init-method", required=True)
    ap.add_argument("--step-address", required=True)
    ap.add_argument("--result-address", required=True)
    a = ap.parse_args(argv)
    logging.basicConfig(level=os.environ.get("TIDAL_LOG_LEVEL", "WARNING"),
                        format=f"%(asctime)s rank{a.rank} %(levelname)s %(name)s: %(message)s")
    sys.exit(run_worker(EngineConfig.from_json(a.config_json), a.rank, a.world_size,
                        a.init_method, a.step_address, a.result_address))


if __name__ == "__main__":
    main()
