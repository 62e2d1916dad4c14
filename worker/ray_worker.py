"""One tensor-parallel rank as a Ray actor (`distributed_executor_backend="ray"`).

The actor wraps the same `Worker` a `MultiprocExecutor` process runs; only the transport
differs. Steps and results cross Ray as msgspec frames (bytes), never as Python objects, so
what a rank receives is exactly what the ZeroMQ path would have delivered. The class is plain
Python: the executor (tidal.core.ray_executor) wraps it with `ray.remote` when it places it, so
importing this module needs no Ray.
"""
from __future__ import annotations

import os
import socket

from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.messages import SchedulerOutput
from tidal.utils.network import listen_socket

Frames = list[bytes]


def _as_bytes(frames: list) -> Frames:
    return [bytes(f) for f in frames]


class RayWorker:
    def __init__(self, config_json: bytes, rank: int, world_size: int) -> None:
        self.config = EngineConfig.from_json(config_json)
        self.rank = rank
        self.world_size = world_size
        self.worker = None
        self._listener: socket.socket | None = None
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(SchedulerOutput)

    def pid(self) -> int:
        return os.getpid()

    def node_ip(self) -> str:
        """The address of this rank's node as Ray knows it (where rank 0 serves the store)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def reserve_rendezvous(self, host: str) -> int:
        """Rank 0: bind (and hold) the port torch.distributed's store will serve on, so no
        other process on this node can take it before `initialize`; returns the port."""
        self._listener = listen_socket(host)
        return int(self._listener.getsockname()[1])

    def initialize(self, init_method: str) -> Frames:
        from tidal.worker.worker import Worker

        listen_fd = self._listener.fileno() if self._listener is not None else None
        self.worker = Worker(self.config, self.rank, self.world_size, init_method, listen_fd)
        info: ResolvedEngineInfo = self.worker.initialize()
        if self._listener is not None:
            self._listener.close()  # the store holds its own descriptor now
            self._listener = None
        return _as_bytes(self._encoder.encode(info))

    def execute_model(self, frames: Frames) -> Frames | None:
        assert self.worker is not None, "execute_model before initialize"
        out = self.worker.execute_model(self._decoder.decode(frames))
        return None if out is None else _as_bytes(self._encoder.encode(out))

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
