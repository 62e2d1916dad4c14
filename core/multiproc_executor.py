"""MultiprocExecutor: one worker process per tensor-parallel rank.

Each step's SchedulerOutput (new requests in full, running ones as deltas) is encoded once;
the same frames (large ones as one shared zero-copy zmq.Frame) go to every rank's socket.
Only rank 0 answers with the sampled tokens; a rank that fails says so on the shared result
socket. While waiting, the executor also watches every worker process, so a failed, dead or
silent rank becomes a `WorkerFailure` (an `EngineDeadError`) naming it and the cause, never a
hang; the other workers are stopped at once and every later call raises the same error.

Nothing is fixed per host: sockets live in a private ipc directory, and the rendezvous port
for torch.distributed is a socket bound here (port 0) and handed to rank 0, so two engines on
one host never collide and no other process can take the port in between.
"""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from typing import Any

import zmq

from tidal.core.executor import Executor
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import ResolvedEngineInfo
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput, WorkerFrame
from tidal.utils.deadline import Deadline
from tidal.utils.network import listen_socket
from tidal.utils.openmp import threads_per_rank
from tidal.core.multinode import HEARTBEAT, NodePlan, NodeRegistry, ranks_of_node, worker_env
from tidal.utils.process import SpawnerThread, stop_processes, wait_all
from tidal.utils.zmq_utils import IpcDir

logger = logging.getLogger(__name__)

_POLL_MS = 100  # longest wait on the result socket between health checks
_ZERO_COPY_MIN = 64 * 1024  # smaller frames are cheaper to copy than to share
# After a rank reports a failure raised inside a collective (most likely a peer's death or
# failure seen from its side), how long to look for the root cause on the other ranks.
_PEER_GRACE_S = 2.0
# After a rank is seen dead, how long to wait for a report it may have sent just before.
_DEATH_GRACE_S = 0.3
_GRACEFUL_EXIT_S = 3.0  # SHUTDOWN -> exit; then SIGTERM, then SIGKILL
STEP, SHUTDOWN = WorkerFrame.STEP, WorkerFrame.SHUTDOWN
READY, OUTPUT, FAILED = WorkerFrame.READY, WorkerFrame.OUTPUT, WorkerFrame.FAILED
IN_COLLECTIVE, WHERE = WorkerFrame.IN_COLLECTIVE, WorkerFrame.WHERE
_PROBE_WAIT_S = 2.0  # how long a timed-out step waits for the ranks to say where they are
_PROBE_WAIT_MS = int(_PROBE_WAIT_S * 1000)
_STARTUP, _IDLE = "start-up", "idle"


class WorkerFailure(EngineDeadError):
    """A worker failed, died or stopped answering; names the rank and the cause."""


def _flag(frames: list[zmq.Frame], i: int) -> bool:
    """Whether a report's optional last frame `i` is the in-a-collective flag."""
    return len(frames) > i and frames[i].bytes == IN_COLLECTIVE


def _exit_cause(code: int) -> str:
    if code < 0:
        try:
            return f"killed by signal {-code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class _Workers:
    """Everything that must be released: processes, sockets, ipc dir, spawner thread.
    `close()` is idempotent and thread-safe; it also runs from a weakref finalizer, so an
    executor that is dropped without shutdown() still leaves nothing behind."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.closed = False
        self.procs: list[subprocess.Popen] = []
        self.step_sockets: list[zmq.Socket] = []
        self.probe_sockets: list[zmq.Socket] = []
        self.ipc: IpcDir | None = None
        self.ctx: zmq.Context | None = None
        self.spawner: SpawnerThread | None = None
        self.registry: NodeRegistry | None = None  # nnodes > 1, until every node registered

    def close(self, graceful: bool = True) -> None:
        with self.lock:
            if self.closed:
                return
            self.closed = True
            procs = self.procs
            try:
                if graceful and procs:
                    for sock, proc in zip(self.step_sockets, procs):
                        if proc.poll() is None:
                            try:
                                sock.send(SHUTDOWN, zmq.NOBLOCK)
                            except zmq.ZMQError:
                                pass
                    wait_all(procs, Deadline(_GRACEFUL_EXIT_S))
                stop_processes(procs, timeout_s=2.0 if graceful else 1.0)
            finally:
                if self.registry is not None:
                    self.registry.close()
                if self.spawner is not None:
                    self.spawner.release()
                if self.ctx is not None:
                    self.ctx.destroy(linger=0)
                if self.ipc is not None:
                    self.ipc.cleanup()


class MultiprocExecutor(Executor):
    # How `python` starts a worker; tests substitute a script that injects faults
    # (tests/fault_injection.py), so the production loop carries no test branches.
    worker_entry: tuple[str, ...] = ("-m", "tidal.worker.worker_proc")

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.world_size = config.tensor_parallel_size
        # Several nodes: this one (node 0) starts its own ranks; the others' agents register
        # (core/multinode.py) and every socket is TCP on master_addr.
        self._tcp_host = config.master_addr if config.nnodes > 1 else None
        self._local_ranks = ranks_of_node(config, 0)
        self._beats: dict[int, float] = {}  # remote node -> its last heartbeat (once all are ready)
        self._w = _Workers()
        self._finalizer = weakref.finalize(self, self._w.close, False)
        self._dead: str | None = None
        self._step = 0
        self._ready: dict[int, ResolvedEngineInfo] = {}
        self.encoder = MsgpackEncoder()
        self.out_decoder = MsgpackDecoder(ModelRunnerOutput)

    @property
    def procs(self) -> list[subprocess.Popen]:
        return self._w.procs

    @property
    def ipc_path(self) -> str | None:
        return self._w.ipc.path if self._w.ipc is not None else None

    # ---------------------------------------------------------------- start-up
    def initialize(self) -> ResolvedEngineInfo:
        try:
            return self._start()
        except BaseException:
            self._w.close(graceful=False)
            raise

    def _start(self) -> ResolvedEngineInfo:
        w = self._w
        w.ipc = IpcDir("tidal-workers-")
        w.ctx = zmq.Context()
        self.results = w.ctx.socket(zmq.PULL)
        self.results.setsockopt(zmq.LINGER, 0)
        self.results.setsockopt(zmq.RCVHWM, 0)
        result_address = self._bind(self.results, "results")
        w.spawner = SpawnerThread("tidal-worker-spawner")
        cfg = self.config
        listener = (listen_socket(cfg.master_addr, port=cfg.master_port) if self._tcp_host is not None
                    else listen_socket("127.0.0.1"))
        try:
            host, port = listener.getsockname()[:2]
            init_method = f"tcp://{host}:{port}"
            args = [sys.executable, *self.worker_entry, "--config-json", cfg.to_json().decode(),
                    "--world-size", str(self.world_size), "--init-method", init_method,
                    "--result-address", result_address]
            # N ranks on one host share its cores (an explicit OMP_NUM_THREADS wins).
            env = (worker_env(cfg) if self._tcp_host is not None
                   else {"OMP_NUM_THREADS": str(threads_per_rank(self.world_size)), **os.environ})
            addresses = [self._rank_sockets(rank) for rank in range(self.world_size)]
            for rank in self._local_ranks:
                self._spawn(rank, [*args, "--step-address", addresses[rank][0], "--probe-address", addresses[rank][1]],
                            env, listener.fileno() if rank == 0 else None)
            if self._tcp_host is not None:
                w.registry = NodeRegistry(cfg, NodePlan(cfg.to_json().decode(), self.world_size, init_method,
                                                        result_address, [a[0] for a in addresses],
                                                        [a[1] for a in addresses]))
            return self._wait_ready()
        finally:
            listener.close()  # rank 0 holds its own copy of the listening socket

    def _bind(self, sock: zmq.Socket, name: str) -> str:
        """An ipc path in the private directory; with several nodes a TCP port on master_addr."""
        assert self._w.ipc is not None
        if self._tcp_host is not None:
            return f"tcp://{self._tcp_host}:{sock.bind_to_random_port(f'tcp://{self._tcp_host}')}"
        address = self._w.ipc.address(name)
        sock.bind(address)
        return address

    def _push_socket(self, name: str) -> tuple[zmq.Socket, str]:
        assert self._w.ctx is not None
        sock = self._w.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        return sock, self._bind(sock, name)

    def _rank_sockets(self, rank: int) -> tuple[str, str]:
        """Rank `rank`'s step and probe sockets (bound here, wherever the rank runs)."""
        steps, step_address = self._push_socket(f"steps-{rank}")
        self._w.step_sockets.append(steps)
        probe, probe_address = self._push_socket(f"probe-{rank}")
        self._w.probe_sockets.append(probe)
        return step_address, probe_address

    def _spawn(self, rank: int, args: list[str], env: dict[str, str], listen_fd: int | None) -> None:
        """Start rank `rank` (its step and probe sockets are in `args`); rank 0 inherits
        `listen_fd`, the rendezvous socket torch.distributed serves its store on."""
        w = self._w
        assert w.spawner is not None
        args = [*args, "--rank", str(rank)]
        if listen_fd is not None:
            args += ["--listen-fd", str(listen_fd)]
        pass_fds = () if listen_fd is None else (listen_fd,)
        w.procs.append(w.spawner.call(lambda: subprocess.Popen(
            args, env=env, stdin=subprocess.DEVNULL, pass_fds=pass_fds, close_fds=True)))

    def _wait_ready(self) -> ResolvedEngineInfo:
        info_decoder = MsgpackDecoder(ResolvedEngineInfo)
        infos = self._ready
        deadline = Deadline(self.config.engine_start_timeout_s)
        while len(infos) < self.world_size:
            kind, rank, payload = self._recv(deadline, _STARTUP)
            if kind != READY:
                self._fail(f"worker rank {rank} sent {kind!r} before it was ready")
            infos[rank] = info_decoder.decode(payload)
        if len({(i.num_kv_blocks, i.max_model_len, i.vocab_size) for i in infos.values()}) != 1:
            self._fail(f"workers disagree on the engine limits: {infos}")
        if self._w.registry is not None:
            self._w.registry.close()
            self._w.registry = None
            now = time.monotonic()
            self._beats = {node: now for node in range(1, self.config.nnodes)}
        return infos[0]

    # ------------------------------------------------------------------- steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._raise_if_down()
        self._step += 1
        deadline = Deadline(self.config.worker_step_timeout_s)
        self._broadcast([STEP, *self.encoder.encode(scheduler_output)], deadline)
        kind, rank, payload = self._recv(deadline, f"step {self._step}")
        if kind != OUTPUT or rank != 0:
            self._fail(f"worker rank {rank} sent {kind!r} during step {self._step}")
        try:
            return self.out_decoder.decode(payload)
        except Exception as e:  # noqa: BLE001
            self._fail(f"worker rank 0 sent a malformed step output: {type(e).__name__}: {e}")
            raise  # unreachable

    def _broadcast(self, frames: list[Any], deadline: Deadline) -> None:
        """The same encoded frames to every rank; a large frame is one zmq.Frame whose memory
        every socket shares (no copy per rank)."""
        msg = [zmq.Frame(f) if len(f) >= _ZERO_COPY_MIN else f for f in frames]
        for rank, sock in enumerate(self._w.step_sockets):
            while True:
                try:
                    sock.send_multipart(msg, flags=zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    # No peer on the socket: the rank is gone (or never connected).
                    self.check_health()
                    if deadline.expired():
                        self._fail(f"worker rank {rank} did not take step {self._step} within "
                                   f"worker_step_timeout_s={self.config.worker_step_timeout_s}s")
                    sock.poll(_POLL_MS, zmq.POLLOUT)

    def _recv(self, deadline: Deadline, what: str) -> tuple[bytes, int, list[Any]]:
        """Next message from any rank; raises WorkerFailure naming the rank and cause when a
        worker fails, dies, or nothing arrives before `deadline`."""
        while True:
            if self.results.poll(_POLL_MS):
                kind, rank, payload = self._read_result()
                if kind == FAILED:
                    self._diagnose(what, {rank: payload}, _PEER_GRACE_S)
                if kind == WHERE:
                    continue  # a late answer to an earlier probe
                if kind == HEARTBEAT:  # `rank` is a node's here
                    self._beats[rank] = time.monotonic()
                    continue
                return kind, rank, payload
            self._check_procs(what)
            if deadline.expired():
                self._timed_out(what)

    def _timed_out(self, what: str) -> None:
        """Ask every rank where its main thread is, then name the stuck one: a rank that does
        not answer, or one busy in this step outside any collective (the others wait for it
        inside one); failing that, rank 0, which owes the answer."""
        for sock in self._w.probe_sockets:
            try:
                sock.send(b"?", zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        where: dict[int, tuple[int, str, bool]] = {}  # rank -> (busy step, stack, in a collective)
        deadline = Deadline(_PROBE_WAIT_S)
        while len(where) < self.world_size and self.results.poll(deadline.remaining_ms(_PROBE_WAIT_MS)):
            kind, rank, payload = self._read_result()
            if kind == WHERE:
                where[rank] = payload
            elif kind == FAILED:
                self._diagnose(what, {rank: payload}, _PEER_GRACE_S)
        ranks = range(self.world_size)
        if what == _STARTUP:
            stuck = [r for r in ranks if r not in self._ready]
            limit = f"start-up within engine_start_timeout_s={self.config.engine_start_timeout_s}s"
            registry = self._w.registry
            if registry is not None and (missing := registry.missing()):
                self._fail(f"node(s) {missing} never registered at {registry.address} within "
                           f"engine_start_timeout_s={self.config.engine_start_timeout_s}s (start each with `tidal serve "
                           f"MODEL --headless --nnodes {self.config.nnodes} --node-rank K --master-addr "
                           f"{self.config.master_addr} --master-port {self.config.master_port}`)")
        else:
            stuck = [r for r in ranks if r not in where or (where[r][0] == self._step and not where[r][2])]
            limit = f"{what} within worker_step_timeout_s={self.config.worker_step_timeout_s}s"
        states = "; ".join(f"rank {r}: {self._rank_state(r, where.get(r))}" for r in ranks)
        self._fail(f"worker rank {stuck[0] if stuck else 0} did not finish {limit} ({states})")

    def _rank_state(self, rank: int, answer: tuple[int, str, bool] | None) -> str:
        if answer is None:
            return "no answer"
        step, stack, in_collective = answer
        state = f"in step {step}" if step else "idle" if rank in self._ready else "starting"
        return f"{state}{', in a collective' if in_collective else ''} at {stack}"

    def _read_result(self) -> tuple[bytes, int, Any]:
        """(kind, rank, payload); the payload of FAILED is (text, in a collective), of WHERE
        (busy step, stack, in a collective), of the others their frames' buffers."""
        frames = self.results.recv_multipart(copy=False)
        kind, rank = frames[0].bytes, int(frames[1].bytes)
        if kind == FAILED:
            return kind, rank, (frames[2].bytes.decode(errors="replace").rstrip(), _flag(frames, 3))
        if kind == WHERE:
            return kind, rank, (int(frames[2].bytes), frames[3].bytes.decode(errors="replace"), _flag(frames, 4))
        return kind, rank, [f.buffer for f in frames[2:]]

    # ------------------------------------------------------------------ failure
    def _check_procs(self, what: str) -> None:
        if any(p.poll() is not None for p in self._w.procs):
            self._diagnose(what, {}, _DEATH_GRACE_S)
        if self._beats:
            bound, now = self.config.heartbeat_timeout_s, time.monotonic()
            for node, beat in self._beats.items():
                if now - beat > bound:
                    ranks = ranks_of_node(self.config, node)
                    self._fail(f"node {node} (worker ranks {ranks.start}-{ranks.stop - 1}) sent no heartbeat for "
                               f"{now - beat:.1f}s (heartbeat_timeout_s={bound:g}s): its host or network is gone")

    def _diagnose(self, what: str, reports: dict[int, tuple[str, bool]], grace_s: float) -> None:
        """Find the root cause among failure reports and dead processes, then fail.

        A failure raised inside a collective is usually a peer's death or failure seen from
        the other side, so look a little longer for a report that is not one, or for a rank
        that died without a word; the first such one is the cause."""
        deadline, death_grace = Deadline(grace_s), Deadline(_DEATH_GRACE_S)

        def settled() -> bool:
            return any(not coll for _, coll in reports.values())

        while not settled() and not deadline.expired():
            if self.results.poll(20):
                kind, rank, payload = self._read_result()
                if kind == FAILED:
                    reports.setdefault(rank, payload)
                continue
            silent_dead = [r for r, p in enumerate(self._w.procs) if p.poll() is not None and r not in reports]
            if silent_dead and death_grace.expired():
                break
        where = {_STARTUP: "during start-up", _IDLE: "while idle"}.get(what, f"in {what}")
        for rank, (text, coll) in reports.items():
            if not coll:
                self._fail(f"worker rank {rank} failed {where}: {text}")
        for rank, proc in enumerate(self._w.procs):
            code = proc.poll()
            if code is not None and rank not in reports:
                self._fail(f"worker rank {rank} died {where} ({_exit_cause(code)})")
        if not reports:
            self._fail(f"the tensor-parallel workers stopped {where}")
        rank, (text, _) = next(iter(reports.items()))
        self._fail(f"worker rank {rank} failed {where}: {text}")

    def _fail(self, message: str) -> None:
        """Record the error, stop every worker now, and raise it (now and on every later call)."""
        if self._dead is None:
            self._dead = message
            logger.error("tensor-parallel workers failed: %s", message)
            self._w.close(graceful=False)
        raise WorkerFailure(self._dead)

    def _raise_if_down(self) -> None:
        if self._dead is not None:
            raise WorkerFailure(self._dead)
        if self._w.closed:
            raise WorkerFailure("the tensor-parallel workers were shut down")

    def check_health(self) -> None:
        self._raise_if_down()
        self._check_procs(_IDLE)

    def shutdown(self) -> None:
        """Stop and reap every worker, remove the ipc directory. Idempotent."""
        self._w.close(graceful=True)
        self._finalizer.detach()
