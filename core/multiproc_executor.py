"""MultiprocExecutor: one worker process per tensor-parallel rank.

Each step's SchedulerOutput (new requests in full, running ones as deltas) is encoded once and
the same frames go to every rank. Only rank 0 answers with the sampled tokens; a rank that
fails says so on the shared result socket. While waiting the executor also watches every
worker process, so a dead or silent rank becomes an error naming it within a poll interval or
the step timeout, never a hang.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import zmq

from tidal.core.executor import Executor
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import ResolvedEngineInfo
from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput, WorkerFrame
from tidal.protocol.process import free_port, stop_process
from tidal.protocol.zmq_utils import IpcDir

logger = logging.getLogger(__name__)

_POLL_MS = 100
STEP, SHUTDOWN = WorkerFrame.STEP, WorkerFrame.SHUTDOWN
READY, OUTPUT, FAILED = WorkerFrame.READY, WorkerFrame.OUTPUT, WorkerFrame.FAILED


class WorkerFailure(RuntimeError):
    pass


class MultiprocExecutor(Executor):
    def initialize(self) -> ResolvedEngineInfo:
        cfg = self.config
        self.world_size = cfg.tensor_parallel_size
        self.ipc = IpcDir("tidal-workers-")
        self.ctx = zmq.Context()
        self.results = self.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        result_address = self.ipc.address("results")
        self.results.bind(result_address)
        self.step_sockets: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        init_method = f"tcp://127.0.0.1:{free_port()}"
        config_json = cfg.to_json().decode()
        for rank in range(self.world_size):
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            address = self.ipc.address(f"steps-{rank}")
            sock.bind(address)
            self.step_sockets.append(sock)
            env = dict(os.environ, TIDAL_WORKER_RANK=str(rank))
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "tidal.worker.worker_proc", "--config-json", config_json,
                 "--rank", str(rank), "--world-size", str(self.world_size),
                 "--init-method", init_method, "--step-address", address,
                 "--result-address", result_address], env=env, stdin=subprocess.DEVNULL))
        self.encoder = MsgpackEncoder()
        self.out_decoder = MsgpackDecoder(ModelRunnerOutput)
        infos: dict[int, ResolvedEngineInfo] = {}
        info_decoder = MsgpackDecoder(ResolvedEngineInfo)
        deadline = time.monotonic() + cfg.engine_start_timeout_s
        try:
            while len(infos) < self.world_size:
                kind, rank, payload = self._recv(deadline, "to start")
                if kind != READY:
                    raise WorkerFailure(f"worker rank {rank} sent {kind!r} before READY")
                infos[rank] = info_decoder.decode(payload)
        except BaseException:
            self.shutdown()
            raise
        return infos[0]

    def _recv(self, deadline: float, what: str) -> tuple[bytes, int, list]:
        """Next message from any rank; raises WorkerFailure naming the rank and cause when a
        worker fails, dies, or nothing arrives before `deadline`."""
        while True:
            if self.results.poll(_POLL_MS):
                frames = self.results.recv_multipart(copy=False)
                kind, rank = frames[0].bytes, int(frames[1].bytes)
                if kind == FAILED:
                    raise WorkerFailure(f"worker rank {rank} failed: {frames[2].bytes.decode(errors='replace')}")
                return kind, rank, [f.buffer for f in frames[2:]]
            self.check_health()
            if time.monotonic() > deadline:
                raise WorkerFailure(f"worker rank 0 did not answer {what} within the timeout")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        frames = [STEP, *self.encoder.encode(scheduler_output)]
        for sock in self.step_sockets:
            sock.send_multipart(frames, copy=False)
        deadline = time.monotonic() + self.config.worker_step_timeout_s
        kind, rank, payload = self._recv(deadline, "a step")
        if kind != OUTPUT or rank != 0:
            raise WorkerFailure(f"unexpected {kind!r} from worker rank {rank} during a step")
        return self.out_decoder.decode(payload)

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                cause = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                raise WorkerFailure(f"worker rank {rank} died ({cause})")

    def shutdown(self) -> None:
        procs = getattr(self, "procs", [])
        for sock in getattr(self, "step_sockets", []):
            try:
                sock.send(SHUTDOWN, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        deadline = time.monotonic() + 3.0
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for proc in procs:
            stop_process(proc, timeout_s=3.0)
        self.procs = []
        if hasattr(self, "ctx"):
            self.ctx.destroy(linger=0)
            del self.ctx
        if hasattr(self, "ipc"):
            self.ipc.cleanup()
