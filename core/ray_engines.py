"""Data-parallel engines placed by Ray (`data_parallel_backend="ray"`, `-dpb ray`).

Each engine core runs where Ray places it: one placement group with a bundle per engine (its
share of CPUs, or tensor_parallel_size GPUs), and in each bundle an `EngineCoreHost` actor that
starts the engine as a headless core process (core/core_proc.py) on its node's address and
restarts it there if it dies. The engines are CURVE-keyed with a key made for this engine at
start (they listen on the node's address, not loopback); the head's front-end reaches each as a
headless core (frontend/dp_client.py), so requests, recovery and metrics work exactly as with
`mp` engines: a lost engine is reconnected on its address and its requests resume on it.
Ray is optional: imported only when this backend is chosen.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from typing import Any

from tidal.core.dp_node import CoreFleet
from tidal.protocol.config import EngineConfig
from tidal.utils.deadline import Deadline

logger = logging.getLogger(__name__)

_RESTART_POLL_S = 0.2


class EngineCoreHost:
    """A Ray actor (wrapped with ray.remote by `RayEngines`): one engine core process on this
    node, kept running at one address (core/dp_node.py's CoreFleet) until `shutdown()`."""

    def __init__(self, config_json: bytes, rank: int, key_json: str, threads: int) -> None:
        self._dir = tempfile.mkdtemp(prefix="tidal-ray-engine-")
        key_file = os.path.join(self._dir, "core.key")
        fd = os.open(key_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(key_json)
        self.config = EngineConfig.from_json(config_json).replace(core_key_file=key_file)
        self.rank, self.threads = rank, threads
        self.fleet: CoreFleet | None = None
        self._stop = threading.Event()

    def start(self) -> str:
        """Start the core; its address (tcp://node_ip:port)."""
        import ray

        from tidal.utils.network import free_port

        host = str(ray.util.get_node_ip_address())
        address = f"tcp://{host}:{free_port(host)}"
        self.fleet = CoreFleet(self.config, range(self.rank, self.rank + 1), [address],
                               env={"OMP_NUM_THREADS": str(self.threads)})
        self.fleet.start()
        threading.Thread(target=self._keep_running, name="tidal-engine-host", daemon=True).start()
        return address

    def _keep_running(self) -> None:
        while not self._stop.wait(_RESTART_POLL_S):
            if self.fleet is not None:
                self.fleet.keep_running()

    def core_pid(self) -> int:
        proc = None if self.fleet is None else self.fleet.procs.get(self.rank)
        return -1 if proc is None else proc.pid

    def shutdown(self) -> None:
        self._stop.set()
        if self.fleet is not None:
            self.fleet.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


class RayEngines:
    """The head's side: place data_parallel_size EngineCoreHost actors and learn their
    addresses; `shutdown()` stops them (and a Ray this started)."""

    def __init__(self, config: EngineConfig) -> None:
        from tidal.core.ray_executor import _import_ray, connect_ray
        from tidal.utils.curve import generate_key_file

        self.ray = ray = _import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.config = config
        self.actors: list[Any] = []
        self._pg: Any = None
        self._dir = tempfile.mkdtemp(prefix="tidal-ray-dp-")
        self.key_file = os.path.join(self._dir, "core.key")
        generate_key_file(self.key_file)
        with open(self.key_file) as f:
            key_json = f.read()
        self._started_ray = connect_ray(ray)
        try:
            n = config.data_parallel_size
            gpu = config.device == "cuda"
            cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // n)
            bundle = {"GPU": config.tensor_parallel_size, "CPU": 1} if gpu else {"CPU": cpus}
            have = ray.cluster_resources()
            if any(have.get(k, 0) < v * n for k, v in bundle.items()):
                raise ValueError(f"data_parallel_size={n} on Ray needs {n} x {bundle} in the cluster, which has "
                                 f"{ {k: have.get(k, 0) for k in bundle} }")
            self._pg = ray.util.placement_group([bundle] * n, strategy="PACK")
            deadline = Deadline(config.engine_start_timeout_s)
            self._get([self._pg.ready()], deadline, "placing the engines (placement group)")
            actor_cls = ray.remote(num_cpus=0)(EngineCoreHost)
            for rank in range(n):
                strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
                self.actors.append(actor_cls.options(scheduling_strategy=strategy, max_restarts=0).remote(
                    config.to_json(), rank, key_json, cpus))
            self.addresses: list[str] = self._get([a.start.remote() for a in self.actors], deadline, "start-up")
        except BaseException:
            self.shutdown()
            raise

    def _get(self, refs: list[Any], deadline: Deadline, what: str) -> list[Any]:
        try:
            return list(self.ray.get(refs, timeout=max(0.001, deadline.remaining_s())))
        except self.ray.exceptions.GetTimeoutError:
            raise RuntimeError(f"data-parallel engines on Ray: {what} did not finish within "
                               f"engine_start_timeout_s={self.config.engine_start_timeout_s:g}s") from None

    def core_pids(self) -> list[int]:
        return list(self.ray.get([a.core_pid.remote() for a in self.actors], timeout=30))

    def shutdown(self) -> None:
        ray = self.ray
        if self.actors:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=20)
            except Exception:  # noqa: BLE001 - killed below either way
                pass
            for actor in self.actors:
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001
                    pass
            self.actors = []
        from tidal.core.ray_executor import release_ray

        release_ray(ray, self._pg, self._started_ray)
        self._pg, self._started_ray = None, False
        shutil.rmtree(self._dir, ignore_errors=True)
