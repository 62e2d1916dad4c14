"""Data-parallel engines on other hosts: the head's registry of them (vLLM's
`--data-parallel-address` / `--data-parallel-rpc-port`).

The head front-end starts its own data_parallel_size_local engines and binds a REP socket at
data_parallel_address:data_parallel_rpc_port. Each other host runs `tidal serve --headless`
(core/dp_node.py), which starts its engines as headless cores (`tidal core`, CURVE-keyed off
loopback with the shared core_key_file) and says hello with their ranks and addresses
(`EngineHello`). The head then reaches each as a headless core: a lost one is reconnected on the
same address within core_reconnect_timeout_s (its host restarts it there) and its requests
resume on it, by the same determinism rule as any core restart.
"""
from __future__ import annotations

import logging
import threading

import msgspec
import zmq

from tidal.protocol.config import EngineConfig
from tidal.protocol.messages import EngineHello, HelloReply
from tidal.utils.deadline import Deadline

logger = logging.getLogger(__name__)

_POLL_MS = 100


class EngineRegistry:
    """Collects the remote engines' addresses from a thread of its own until `close()`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.address = f"tcp://{config.data_parallel_address}:{config.data_parallel_rpc_port}"
        self.engines: dict[int, str] = {}  # rank -> address
        self._changed = threading.Condition()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.address)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidal-dp-registry", daemon=True)
        self._thread.start()

    def _check(self, hello: EngineHello) -> str | None:
        cfg = self.config
        ranks = range(hello.start_rank, hello.start_rank + len(hello.addresses))
        if hello.data_parallel_size != cfg.data_parallel_size:
            return f"it has data_parallel_size={hello.data_parallel_size}, the head {cfg.data_parallel_size}"
        if not hello.addresses or ranks.start < cfg.dp_local_size or ranks.stop > cfg.data_parallel_size:
            return (f"ranks {list(ranks)} are not among the remote ranks {cfg.dp_local_size} .. "
                    f"{cfg.data_parallel_size - 1}")
        if taken := [r for r in ranks if r in self.engines and self.engines[r] != hello.addresses[r - ranks.start]]:
            return f"ranks {taken} registered already at other addresses"
        return None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                if not self._sock.poll(_POLL_MS):
                    continue
                raw = self._sock.recv()
                try:
                    hello = msgspec.json.decode(raw, type=EngineHello)
                    error = self._check(hello)
                except msgspec.DecodeError as e:
                    hello, error = None, f"malformed registration: {e}"
                self._sock.send(msgspec.json.encode(HelloReply(error)))
                if error is None and hello is not None:
                    with self._changed:
                        for i, address in enumerate(hello.addresses):
                            self.engines[hello.start_rank + i] = address
                        self._changed.notify_all()
                    logger.info("data-parallel engines %d.. registered at %s", hello.start_rank, hello.addresses)
                elif error is not None:
                    logger.error("refused a data-parallel engine registration: %s", error)
            except zmq.ZMQError:
                return

    def wait(self, ranks: range, timeout_s: float) -> dict[int, str]:
        """Every rank's address; RuntimeError naming the missing ranks after timeout_s."""
        deadline = Deadline(timeout_s)
        with self._changed:
            while missing := [r for r in ranks if r not in self.engines]:
                if deadline.expired():
                    raise RuntimeError(
                        f"data-parallel engine(s) {missing} never registered at {self.address} within "
                        f"engine_start_timeout_s={timeout_s:g}s (start them with `tidal serve MODEL --headless "
                        f"--data-parallel-size {self.config.data_parallel_size} --data-parallel-size-local L "
                        f"--data-parallel-start-rank R --data-parallel-address {self.config.data_parallel_address} "
                        f"--data-parallel-rpc-port {self.config.data_parallel_rpc_port}`)")
                self._changed.wait(min(0.5, deadline.remaining_s()))
        return {r: self.engines[r] for r in ranks}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._ctx.destroy(linger=0)
