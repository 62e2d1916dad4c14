"""Tensor parallelism across hosts: the leader's registry and the other nodes' agent.

With `nnodes = M`, node 0 runs the engine core and its MultiprocExecutor; each of the
tensor_parallel_size // M ranks of node K lives on node K. Every byte between nodes goes over
TCP at addresses the leader binds on `master_addr` (never an ipc path or shared memory):

- torch.distributed's TCP store at master_addr:master_port (served by rank 0);
- `NodeRegistry` (a thread of the leader's executor) at master_addr:master_port + 1: a node's
  agent says hello (`NodeHello`) and gets its `NodePlan` -- the leader's EngineConfig, the
  rendezvous, and each of its ranks' step and probe sockets -- so every node runs exactly the
  leader's configuration;
- the step sockets (the scheduler output of each step, to every rank) and the one result
  socket (rank 0's sampled ids; any rank's failure report; each agent's heartbeat).

`run_node_agent` (`tidal serve --headless --nnodes M --node-rank K ...`) registers, starts its
node's ranks as worker processes, and watches them: a rank that dies is reported to the leader
at once (FAILED naming it), and a heartbeat every HEARTBEAT_S lets the leader notice a node
that vanished (no FIN) within heartbeat_timeout_s. When the leader goes (its connection drops,
ZMTP heartbeats cover a vanished leader) or a rank dies, the agent stops its ranks and
registers again: a restarted engine core finds its nodes waiting.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import msgspec
import zmq

from tidal.protocol.config import EngineConfig
from tidal.protocol.messages import WorkerFrame
from tidal.utils.network import interface_towards
from tidal.utils.openmp import threads_per_rank
from tidal.utils.process import stop_processes
from tidal.utils.zmq_utils import Heartbeat, request_until_answered

logger = logging.getLogger(__name__)

HEARTBEAT = b"H"  # agent -> leader on the result socket: [HEARTBEAT, node rank]
HEARTBEAT_S = 1.0
_POLL_MS = 100
_EXITED = "exited"


class NodeHello(msgspec.Struct):
    node_rank: int
    nnodes: int
    tensor_parallel_size: int
    model: str


class NodePlan(msgspec.Struct):
    config_json: str  # the leader's EngineConfig
    world_size: int
    init_method: str  # tcp://master_addr:master_port
    result_address: str
    step_addresses: list[str]  # per global rank
    probe_addresses: list[str]
    error: str | None = None  # set instead: the registration is refused (the agent exits)


def ranks_of_node(config: EngineConfig, node: int) -> range:
    local = config.tensor_parallel_size // config.nnodes
    return range(node * local, (node + 1) * local)


def worker_env(config: EngineConfig) -> dict[str, str]:
    """A rank's environment on any node: its share of the node's cores, and gloo's interface
    the one that reaches master_addr (gloo would otherwise take the hostname's address, often
    127.0.1.1, which no other host can reach). The user's own settings win."""
    env = {"OMP_NUM_THREADS": str(threads_per_rank(config.tensor_parallel_size // config.nnodes))}
    if (iface := interface_towards(config.master_addr)) is not None:
        env["GLOO_SOCKET_IFNAME"] = iface
    return {**env, **os.environ}


class NodeRegistry:
    """The leader's answer to each node's hello, from a thread of its own until `close()`."""

    def __init__(self, config: EngineConfig, plan: NodePlan) -> None:
        self.config, self.plan = config, plan
        self.registered: dict[int, float] = {}  # node -> when it registered
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://{config.master_addr}:{config.master_port + 1}"
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-node-registry", daemon=True)
        self._thread.start()

    def _answer(self, raw: bytes) -> NodePlan:
        cfg = self.config
        try:
            hello = msgspec.json.decode(raw, type=NodeHello)
        except msgspec.DecodeError as e:
            return msgspec.structs.replace(self.plan, error=f"malformed registration: {e}")
        if (hello.nnodes, hello.tensor_parallel_size) != (cfg.nnodes, cfg.tensor_parallel_size):
            return msgspec.structs.replace(self.plan, error=(
                f"this node has nnodes={hello.nnodes} tensor_parallel_size={hello.tensor_parallel_size}; the "
                f"leader runs nnodes={cfg.nnodes} tensor_parallel_size={cfg.tensor_parallel_size}"))
        if not 0 < hello.node_rank < cfg.nnodes:
            return msgspec.structs.replace(self.plan, error=f"node_rank {hello.node_rank} is not in [1, {cfg.nnodes})")
        if hello.node_rank in self.registered:
            return msgspec.structs.replace(self.plan, error=f"node {hello.node_rank} registered already")
        self.registered[hello.node_rank] = time.monotonic()
        logger.info("node %d registered (worker ranks %s)", hello.node_rank, list(ranks_of_node(cfg, hello.node_rank)))
        return self.plan

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if self._sock.poll(_POLL_MS):
                    self._sock.send(msgspec.json.encode(self._answer(self._sock.recv())))
            except zmq.ZMQError:
                return

    def missing(self) -> list[int]:
        return [n for n in range(1, self.config.nnodes) if n not in self.registered]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._ctx.destroy(linger=0)


# ---------------------------------------------------------------------------- the agent
def _register(config: EngineConfig, stop: threading.Event) -> NodePlan | None:
    """Say hello until the leader answers; None once `stop` is set, ValueError if refused."""
    address = f"tcp://{config.master_addr}:{config.master_port + 1}"
    hello = msgspec.json.encode(NodeHello(config.node_rank, config.nnodes, config.tensor_parallel_size, config.model))
    logger.info("node %d: registering with the leader at %s", config.node_rank, address)
    answer = request_until_answered(address, hello, stop)
    if answer is None:
        return None
    plan = msgspec.json.decode(answer, type=NodePlan)
    if plan.error is not None:
        raise ValueError(f"the leader at {address} refused node {config.node_rank}: {plan.error}")
    return plan


def _spawn_ranks(config: EngineConfig, plan: NodePlan) -> dict[int, subprocess.Popen]:
    leader = EngineConfig.from_json(plan.config_json)
    env = worker_env(leader)
    procs: dict[int, subprocess.Popen] = {}
    for rank in ranks_of_node(leader, config.node_rank):
        args = [sys.executable, "-m", "tidal.worker.worker_proc", "--config-json", plan.config_json,
                "--world-size", str(plan.world_size), "--init-method", plan.init_method,
                "--result-address", plan.result_address, "--rank", str(rank),
                "--step-address", plan.step_addresses[rank], "--probe-address", plan.probe_addresses[rank]]
        procs[rank] = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, close_fds=True)
    return procs


def _watch(config: EngineConfig, plan: NodePlan, procs: dict[int, subprocess.Popen], stop: threading.Event) -> str:
    """Heartbeats to the leader while the ranks run; returns why it stopped watching."""
    ctx = zmq.Context()
    try:
        out = ctx.socket(zmq.PUSH)
        out.setsockopt(zmq.LINGER, 1000)
        Heartbeat(config.heartbeat_timeout_s).apply(out)
        monitor = out.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        out.connect(plan.result_address)
        me = str(config.node_rank).encode()
        next_beat = 0.0
        while not stop.is_set():
            if monitor.poll(_POLL_MS):
                return "the leader's connection dropped"
            for rank, proc in procs.items():
                if (code := proc.poll()) is not None:
                    if code != 0:
                        cause = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                        out.send_multipart([WorkerFrame.FAILED, str(rank).encode(),
                                            f"its process on node {config.node_rank} died ({cause})".encode()])
                    return f"worker rank {rank} {_EXITED} ({code})"
            if time.monotonic() >= next_beat:
                out.send_multipart([HEARTBEAT, me], zmq.NOBLOCK)
                next_beat = time.monotonic() + HEARTBEAT_S
        return "stopped"
    except zmq.ZMQError as e:
        return f"the connection to the leader failed ({e})"
    finally:
        ctx.destroy(linger=1000)


def run_node_agent(config: EngineConfig, stop: threading.Event | None = None) -> int:
    """Node `config.node_rank` of a multi-node engine, until `stop` (SIGTERM)."""
    stop = stop or threading.Event()
    if config.node_rank == 0 or config.nnodes < 2:
        raise ValueError("a headless node is node_rank 1 .. nnodes - 1 of a multi-node engine (nnodes > 1)")
    while not stop.is_set():
        plan = _register(config, stop)
        if plan is None:
            break
        procs = _spawn_ranks(config, plan)
        try:
            why = _watch(config, plan, procs, stop)
        finally:
            stop_processes(list(procs.values()), timeout_s=3.0)
        logger.warning("node %d: worker ranks %s stopped (%s); waiting for the leader again",
                       config.node_rank, sorted(procs), why)
    return 0
