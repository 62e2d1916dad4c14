"""RayExecutor: the tensor-parallel ranks as Ray actors (`distributed_executor_backend="ray"`).

The same `Worker` a `MultiprocExecutor` process runs is placed as an actor (tidal.worker.
ray_worker) in one placement group, a bundle per rank ({"GPU": 1} on CUDA, {"CPU": 1}
otherwise), so Ray decides which node each rank lands on and the ranks rendezvous through
torch.distributed's TCP store on rank 0's node, as every other tidal TP group does. Each step's
SchedulerOutput is encoded once with msgspec and the same frames go to every rank; only rank 0
answers with the sampled ids.

Ray is optional (`pip install ray`): it is imported here only when this backend is chosen. With
`RAY_ADDRESS` set the core joins that cluster; otherwise it starts a private local one and
stops it again at shutdown. Every wait is bounded: placement by engine_start_timeout_s, a step
by worker_step_timeout_s, and a rank whose actor dies (or whose node goes) fails the step at
once as a `WorkerFailure` naming it, never a hang.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from tidal.core.executor import Executor
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput
from tidal.utils.deadline import Deadline

logger = logging.getLogger(__name__)

_POLL_S = 0.5  # longest wait on the ranks' results between deadline checks
_PEER_GRACE_S = 2.0  # after an error raised in a rank, how long to look for a peer that died
_HEALTH_TIMEOUT_S = 10.0  # an idle rank must answer a ping within this
_KILL_GRACE_S = 5.0  # a rank's graceful shutdown call, before its actor is killed


class WorkerFailure(EngineDeadError):
    """A Ray rank failed, died or stopped answering; names the rank and the cause."""


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ValueError("distributed_executor_backend='ray' needs Ray, which is not installed: "
                         "pip install ray") from e
    return ray


def connect_ray(ray: Any) -> bool:
    """Join the cluster at RAY_ADDRESS, else start a private local one; True when this call
    started one (its owner stops it with ray.shutdown())."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no phoning home from the engine
    if address:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
        return False
    ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    return True


def release_ray(ray: Any, placement_group: Any, started: bool) -> None:
    """Free a placement group (None: none) and stop the Ray that `connect_ray` started."""
    if placement_group is not None:
        try:
            ray.util.remove_placement_group(placement_group)
        except Exception:  # noqa: BLE001 - gone with the cluster
            pass
    if started and ray.is_initialized():
        ray.shutdown()


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.tensor_parallel_size
        self.actors: list[Any] = []
        self._pg: Any = None
        self._started_ray = False
        self._dead: str | None = None
        self._step = 0
        self.encoder = MsgpackEncoder()
        self.out_decoder = MsgpackDecoder(ModelRunnerOutput)

    # ---------------------------------------------------------------- start-up
    def initialize(self) -> ResolvedEngineInfo:
        try:
            return self._start()
        except BaseException:
            self.shutdown()
            raise

    def _start(self) -> ResolvedEngineInfo:
        ray = self.ray = _import_ray()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from tidal.worker.ray_worker import RayWorker

        self._connect(ray)
        deadline = Deadline(self.config.engine_start_timeout_s)
        resource = "GPU" if self.config.device == "cuda" else "CPU"
        self._check_resources(ray, resource)
        self._pg = ray.util.placement_group([{resource: 1}] * self.world_size, strategy="PACK")
        self._wait([self._pg.ready()], deadline, "placing the ranks (placement group)")
        actor_cls = ray.remote(num_cpus=1 if resource == "CPU" else 0,
                               num_gpus=1 if resource == "GPU" else 0)(RayWorker)
        config_json = self.config.to_json()
        for rank in range(self.world_size):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(scheduling_strategy=strategy, max_restarts=0).remote(
                config_json, rank, self.world_size))
        # The store is served by rank 0 on its node's address: Ray may have put it elsewhere.
        host = self._wait([self.actors[0].node_ip.remote()], deadline, _STARTUP)[0]
        port = self._wait([self.actors[0].reserve_rendezvous.remote(host)], deadline, _STARTUP)[0]
        infos = self._wait([a.initialize.remote(f"tcp://{host}:{port}") for a in self.actors], deadline, _STARTUP)
        decoder = MsgpackDecoder(ResolvedEngineInfo)
        resolved = [decoder.decode(frames) for frames in infos]
        if len({(i.num_kv_blocks, i.max_model_len, i.vocab_size) for i in resolved}) != 1:
            self._fail(f"Ray ranks disagree on the engine limits: {resolved}")
        logger.info("Ray executor: %d rank(s) on %s", self.world_size, host)
        return resolved[0]

    def _connect(self, ray: Any) -> None:
        self._started_ray = connect_ray(ray)

    def _check_resources(self, ray: Any, resource: str) -> None:
        have = ray.cluster_resources().get(resource, 0)
        if have < self.world_size:
            raise ValueError(f"tensor_parallel_size={self.world_size} needs {self.world_size} {resource}(s) in the "
                             f"Ray cluster, which has {have:g}")

    # ------------------------------------------------------------------- steps
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._raise_if_down()
        self._step += 1
        frames = [bytes(f) for f in self.encoder.encode(scheduler_output)]
        refs = [a.execute_model.remote(frames) for a in self.actors]
        outs = self._wait(refs, Deadline(self.config.worker_step_timeout_s), f"step {self._step}")
        if outs[0] is None:
            self._fail(f"worker rank 0 returned no output for step {self._step}")
        try:
            return self.out_decoder.decode(outs[0])
        except Exception as e:  # noqa: BLE001
            self._fail(f"worker rank 0 sent a malformed step output: {type(e).__name__}: {e}")
            raise  # unreachable

    def _wait(self, refs: list[Any], deadline: Deadline, what: str) -> list[Any]:
        """Every ref's value, in order. The first rank to fail or die fails the whole step
        (its peers would only wait for it in a collective); so does the deadline."""
        ray = self.ray
        index = {ref: i for i, ref in enumerate(refs)}
        values: list[Any] = [None] * len(refs)
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=min(_POLL_S, deadline.remaining_s()))
            for ref in done:
                try:
                    values[index[ref]] = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - RayActorError, RayTaskError, ...
                    if not isinstance(e, ray.exceptions.RayActorError) and pending:
                        # An error raised in a rank (a collective's "connection reset") is most
                        # often a peer's death seen from there: name the dead peer if there is one.
                        self._fail_on_dead_peer(pending, index, what)
                    self._fail(f"worker rank {index[ref]} failed {_where(what)}: {_describe(e)}")
            if pending and deadline.expired():
                ranks = ", ".join(str(index[r]) for r in pending)
                limit = "engine_start_timeout_s" if what == _STARTUP else "worker_step_timeout_s"
                self._fail(f"worker rank(s) {ranks} did not finish {what} within {limit}")
        return values

    def _fail_on_dead_peer(self, pending: list[Any], index: dict[Any, int], what: str) -> None:
        """Fail naming the first of `pending`'s ranks whose actor died within _PEER_GRACE_S."""
        ray = self.ray
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=_PEER_GRACE_S)
        for ref in sorted(done, key=index.__getitem__):
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                self._fail(f"worker rank {index[ref]} died {_where(what)}: {_describe(e)}")
            except Exception:  # noqa: BLE001 - another in-rank error: not the root cause either
                continue

    # ------------------------------------------------------------------ failure
    def _fail(self, message: str) -> None:
        if self._dead is None:
            self._dead = message
            logger.error("Ray tensor-parallel workers failed: %s", message)
            self._kill_actors()
        raise WorkerFailure(self._dead)

    def _raise_if_down(self) -> None:
        if self._dead is not None:
            raise WorkerFailure(self._dead)
        if not self.actors:
            raise WorkerFailure("the Ray workers were shut down")

    def check_health(self) -> None:
        self._raise_if_down()
        self._wait([a.pid.remote() for a in self.actors], Deadline(_HEALTH_TIMEOUT_S), _IDLE)

    def _kill_actors(self) -> None:
        ray = getattr(self, "ray", None)
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []

    def shutdown(self) -> None:
        """Stop every rank, free the placement group, stop a Ray this executor started."""
        ray = getattr(self, "ray", None)
        if ray is None:
            return
        if self.actors and self._dead is None:
            try:
                ray.get([a.shutdown.remote() for a in self.actors], timeout=_KILL_GRACE_S)
            except Exception:  # noqa: BLE001 - killed below either way
                pass
        self._kill_actors()
        release_ray(ray, self._pg, self._started_ray)
        self._pg, self._started_ray = None, False


_STARTUP, _IDLE = "start-up", "idle"


def _where(what: str) -> str:
    return {_STARTUP: "during start-up", _IDLE: "while idle"}.get(what, f"in {what}")


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[-1] if text else ''}"
