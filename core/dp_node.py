"""A host of data-parallel engines for a head on another host (`tidal serve --headless
--data-parallel-size N --data-parallel-size-local L --data-parallel-start-rank R
--data-parallel-address HEAD --data-parallel-rpc-port P`).

It starts engines R .. R+L-1 as headless cores (core/core_proc.py) bound on TCP at this host's
address towards HEAD (CURVE-keyed with core_key_file off loopback: the head's front-end holds
the same file), registers their addresses with the head (frontend/dp_remote.py), and restarts
an engine that dies on the same address: the head reconnects within core_reconnect_timeout_s
and resumes that engine's requests on it. SIGTERM stops every engine.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import msgspec

from tidal.protocol.config import EngineConfig
from tidal.protocol.messages import EngineHello, HelloReply
from tidal.utils.curve import check_bind_security
from tidal.utils.network import free_port, local_address_towards
from tidal.utils.openmp import compute_process_env
from tidal.utils.process import stop_processes
from tidal.utils.zmq_utils import request_until_answered

logger = logging.getLogger(__name__)

MAX_RESTARTS = 10  # per engine, within RESTART_WINDOW_S; then the host gives up on it
RESTART_WINDOW_S = 600.0


class CoreFleet:
    """Engine cores of ranks `ranks` serving headless at `addresses`, each restarted on its
    address when it dies (at most MAX_RESTARTS within RESTART_WINDOW_S): the front-ends that
    reach them reconnect and resume their requests. Also serves `tidal serve --api-server-count`."""

    def __init__(self, config: EngineConfig, ranks: range, addresses: list[str],
                 env: dict[str, str] | None = None) -> None:
        """`env`: more environment for the cores (under os.environ's, see compute_process_env)."""
        self.config, self.ranks, self.addresses, self.env = config, ranks, addresses, env
        self.procs: dict[int, subprocess.Popen | None] = {}
        self._restarts: dict[int, list[float]] = {rank: [] for rank in ranks}

    def _spawn(self, rank: int, address: str) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "tidal.core.core_proc", "--address", address,
               "--config-json", self.config.replace(data_parallel_rank=rank).to_json().decode(),
               "--parent-pid", str(os.getpid())]
        if self.config.core_key_file is not None:
            cmd += ["--key-file", self.config.core_key_file]
        return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, close_fds=True, env=compute_process_env(self.env))

    def start(self) -> None:
        for rank, address in zip(self.ranks, self.addresses):
            self.procs[rank] = self._spawn(rank, address)

    def keep_running(self) -> None:
        """One look: restart each core that died (within its budget)."""
        for rank, address in zip(self.ranks, self.addresses):
            proc = self.procs.get(rank)
            if proc is None or (code := proc.poll()) is None:
                continue
            now = time.monotonic()
            recent = [t for t in self._restarts[rank] if now - t < RESTART_WINDOW_S]
            if len(recent) >= MAX_RESTARTS:
                logger.error("engine %d died (exit %s) %d times within %gs: not restarted", rank, code,
                             len(recent), RESTART_WINDOW_S)
                self.procs[rank] = None
                continue
            logger.warning("engine %d died (exit %s); restarting it at %s", rank, code, address)
            self._restarts[rank] = [*recent, now]
            self.procs[rank] = self._spawn(rank, address)

    def stop(self) -> None:
        stop_processes([p for p in self.procs.values() if p is not None], timeout_s=10.0)


def _register(config: EngineConfig, addresses: list[str], stop: threading.Event) -> bool:
    """Say hello until the head answers; False once `stop` is set, ValueError if refused."""
    head = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
    hello = msgspec.json.encode(EngineHello(config.data_parallel_start_rank or 0, addresses,
                                            config.data_parallel_size, config.model))
    answer = request_until_answered(head, hello, stop)
    if answer is None:
        return False
    reply = msgspec.json.decode(answer, type=HelloReply)
    if reply.error is not None:
        raise ValueError(f"the head at {head} refused these engines: {reply.error}")
    logger.info("engines registered with the head at %s: %s", head, addresses)
    return True


def run_dp_node(config: EngineConfig, stop: threading.Event | None = None) -> int:
    stop = stop or threading.Event()
    start = config.data_parallel_start_rank or 0
    if start == 0 or config.data_parallel_address is None or config.data_parallel_rpc_port is None:
        raise ValueError("headless data-parallel engines need --data-parallel-start-rank >= 1 (rank 0 is the "
                         "head's), --data-parallel-address and --data-parallel-rpc-port (the head's)")
    host = local_address_towards(config.data_parallel_address)
    ranks = range(start, start + config.dp_local_size)
    addresses = [f"tcp://{host}:{free_port(host)}" for _ in ranks]
    check_bind_security(addresses[0], config.core_key_file)  # before any engine loads
    fleet = CoreFleet(config, ranks, addresses)
    fleet.start()
    try:
        if not _register(config, addresses, stop):
            return 0
        while not stop.wait(0.2):
            fleet.keep_running()
        return 0
    finally:
        fleet.stop()
