"""Data parallelism on one host (vLLM's `data_parallel_size`): N engine cores, each with its own
tensor-parallel workers, behind one front-end.

`DPSyncClient` (LLM) and `DPAsyncClient` (AsyncLLM) hold one ordinary client per core
(core_client.py: its process, socket, watcher and supervisor) and present the interface of one:

- Routing: a request pinned with `data_parallel_rank` goes to that core; any other to the least
  loaded live core. The load is vLLM's score, 4 x waiting + running, from the `SchedulerStats`
  each core sends with its outputs when stats are on, plus the requests this front-end sent it
  since (they wait there until its next stats say otherwise); with stats off it is this
  front-end's own count of the core's open requests, which is exact when the front-end is the
  core's only client. Ties go round-robin.
- Each request stays with its core: its aborts go there, and so does its resubmission after a
  crash. `_rank_of` keeps an id until the core's final output for it came (an aborted request's
  too), so a restart resumes exactly the requests its lost core held.
- Recovery is per core: each core's own supervisor restarts it and the front-end resumes that
  core's requests only (FrontEnd._resume_requests with its rank); the other cores keep going.
  A core that dies for good (restarts used up) takes the engine down: every other core is
  failed with it, so every stream ends with EngineDeadError rather than some never ending.
- Where the cores run: this host (`mp`, each core with its share of the CPUs or its device
  group); other hosts, whose engines register with this head (frontend/dp_remote.py,
  core/dp_node.py); or wherever Ray places them (`data_parallel_backend="ray"`,
  core/ray_engines.py). The last two are reached as headless cores over CURVE-keyed TCP.
- Outputs of all cores are merged in arrival order, each message stamped with its
  `engine_index` (metrics carry vLLM's `engine` label per core); utility calls go to every core
  and their results are merged (MERGE).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import zmq
import zmq.asyncio

from tidal.frontend.core_client import AsyncMPClient, SyncMPClient
from tidal.frontend.core_connection import POLL_MS
from tidal.frontend.dp_remote import EngineRegistry
from tidal.frontend.supervisor import CoreState, CoreSupervisor
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tidal.utils.deadline import Deadline

if TYPE_CHECKING:
    from tidal.core.ray_engines import RayEngines

logger = logging.getLogger(__name__)

M = TypeVar("M", SyncMPClient, AsyncMPClient)
WAITING_WEIGHT = 4  # vLLM's: a waiting request counts four times a running one


class SupervisorGroup:
    """The cores' supervisors read as one, for the front-ends that know a single `supervisor`:
    DEAD when any is (the engine is dead), else LOST when any core is lost (its recovery is due),
    else RECONNECTING while one restarts, else LIVE. `recover()` restarts every lost core."""

    def __init__(self, members: Sequence[CoreSupervisor]) -> None:
        self.members = list(members)

    @property
    def state(self) -> CoreState:
        states = {m.state for m in self.members}
        for state in (CoreState.DEAD, CoreState.LOST, CoreState.RECONNECTING):
            if state in states:
                return state
        return CoreState.LIVE

    @property
    def live(self) -> bool:
        return all(m.live for m in self.members)

    @property
    def restarting(self) -> bool:
        return self.error is None and any(m.restarting for m in self.members)

    @property
    def reason(self) -> str | None:
        return next((f"engine core {r}: {m.reason}" for r, m in enumerate(self.members)
                     if not m.live and m.reason is not None), None)

    @property
    def error(self) -> EngineDeadError | None:
        return next((m.error for m in self.members if m.error is not None), None)

    @property
    def dead_by_shutdown(self) -> bool:
        return next((m.dead_by_shutdown for m in self.members if m.error is not None), False)

    @property
    def num_restarts(self) -> int:
        return sum(m.num_restarts for m in self.members)

    @property
    def shutting_down(self) -> bool:
        return any(m.shutting_down for m in self.members)

    @shutting_down.setter
    def shutting_down(self, value: bool) -> None:
        for m in self.members:
            m.shutting_down = value

    def check(self) -> None:
        if (error := self.error) is not None:
            raise error

    def core_gone(self, reason: str, *, restartable: bool = True,
                  failed_step_request_ids: list[str] | None = None) -> None:
        """A failure of the front-end's own (its output handler): every core is gone with it."""
        for m in self.members:
            m.core_gone(reason, restartable=restartable, failed_step_request_ids=failed_step_request_ids)

    def fail(self, reason: str) -> EngineDeadError:
        errors = [m.fail(reason) for m in self.members]
        return errors[0]

    def shutdown(self) -> None:
        for m in self.members:
            m.shutdown()

    def recover(self) -> list[Any]:
        give_up: list[Any] = []
        for m in self.members:
            if m.state is CoreState.LOST:
                give_up += m.recover()
        return give_up

    async def recover_async(self) -> list[Any]:
        give_up: list[Any] = []
        for m in self.members:
            if m.state is CoreState.LOST:
                give_up += await m.recover_async()
        return give_up


def merge_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """The engine's stats as one core's: counts summed, KV usage over all cores' blocks."""
    total = SchedulerStats()
    per_pos: list[int] = []
    used = 0.0
    for s in stats:
        for name in SchedulerStats.__struct_fields__:
            value = getattr(s, name)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(total, name, getattr(total, name) + value)
        used += s.kv_cache_usage * s.num_total_blocks
        pos = s.spec_decode_num_accepted_tokens_per_pos
        per_pos += [0] * (len(pos) - len(per_pos))
        for i, accepted in enumerate(pos):
            per_pos[i] += accepted
    total.kv_cache_usage = used / total.num_total_blocks if total.num_total_blocks else 0.0
    total.spec_decode_num_accepted_tokens_per_pos = per_pos
    return total


def _sum_tuples(results: Sequence[Any]) -> Any:
    return tuple(sum(column) for column in zip(*results))


# How a utility's per-core results become one (default: core 0's).
MERGE: dict[str, Callable[[list[Any]], Any]] = {
    "get_stats": merge_stats,
    "reset_prefix_cache": lambda results: all(bool(r) for r in results),
    "get_timing": _sum_tuples,  # (step s, forward s, steps): totals over the cores
}


def merge_utility(method: str, results: list[Any]) -> Any:
    return MERGE.get(method, lambda rs: rs[0])(results)


class _DPClient(Generic[M]):
    def __init__(self, config: EngineConfig, member: Callable[[EngineConfig], M]) -> None:
        if config.core_address is not None:
            raise ValueError("data parallelism starts its own engine cores; core_address names one")
        self.config = config
        self.clients: list[M] = []
        self._ray: RayEngines | None = None
        try:
            if config.engine_core_addresses is not None:  # running already (--api-server-count)
                for rank, address in enumerate(config.engine_core_addresses):
                    self.clients.append(member(config.replace(data_parallel_rank=rank, core_address=address)))
            elif config.data_parallel_backend == "ray":  # every engine where Ray puts it
                from tidal.core.ray_engines import RayEngines

                self._ray = RayEngines(config)
                for rank, address in enumerate(self._ray.addresses):
                    self.clients.append(member(config.replace(data_parallel_rank=rank, core_address=address,
                                                              core_key_file=self._ray.key_file)))
            else:
                for rank in range(config.dp_local_size):
                    self.clients.append(member(config.replace(data_parallel_rank=rank)))
            if (config.engine_core_addresses is None and config.data_parallel_backend != "ray"
                    and config.dp_local_size < config.data_parallel_size):
                # The other hosts register theirs.
                registry = EngineRegistry(config)
                try:
                    remote = registry.wait(range(config.dp_local_size, config.data_parallel_size),
                                           config.engine_start_timeout_s)
                finally:
                    registry.close()
                for rank, address in remote.items():  # each a headless core: reconnected when lost
                    self.clients.append(member(config.replace(data_parallel_rank=rank, core_address=address)))
        except BaseException:
            self.shutdown()
            raise
        n = len(self.clients)
        self.supervisor = SupervisorGroup([c.supervisor for c in self.clients])
        for rank, c in enumerate(self.clients):
            c.supervisor.attach_dead_callback(lambda error, rank=rank: self._member_dead(rank, error))
        self.info: ResolvedEngineInfo | None = None
        self._rank_of: dict[str, int] = {}  # request id -> its core, until its final output came
        self._open = [0] * n  # this front-end's requests per core (entries of _rank_of)
        self._published: list[int | None] = [None] * n  # 4 waiting + running, from each core's last stats
        self._sent_since = [0] * n  # requests sent to each core since its last stats
        self._turn = 0  # round-robin start for ties and for reading

    @property
    def supervisors(self) -> list[CoreSupervisor]:
        return [c.supervisor for c in self.clients]

    def _member_dead(self, rank: int, error: EngineDeadError) -> None:
        """One core died for good: so does the engine (the others are failed with it)."""
        if error.args and "shut down" in str(error):
            return  # a shutdown reaches every core itself
        for r, m in enumerate(self.supervisors):
            if r != rank and m.error is None:
                m.fail(f"engine core {rank} of the data-parallel engine is dead: {error}")

    def wait_ready(self) -> ResolvedEngineInfo:
        infos = [c.wait_ready() for c in self.clients]
        first = infos[0]
        for rank, info in enumerate(infos[1:], 1):
            if (info.max_model_len, info.vocab_size) != (first.max_model_len, first.vocab_size):
                raise RuntimeError(f"data-parallel engine core {rank} has other limits ({info}) than core 0 ({first})")
        self.info = first
        return first

    # ------------------------------------------------------------------ routing
    def _load(self, rank: int) -> int:
        published = self._published[rank]
        if published is None:
            return self._open[rank]
        return published + WAITING_WEIGHT * self._sent_since[rank]

    def _pick(self, request: EngineCoreRequest) -> int:
        if request.data_parallel_rank is not None:
            return request.data_parallel_rank  # in range: the front-end checked
        n = len(self.clients)
        live = [r for r in range(n) if self.clients[r].supervisor.live] or list(range(n))
        rank = min(live, key=lambda r: (self._load(r), (r - self._turn) % n))
        self._turn = (rank + 1) % n
        return rank

    def add_request(self, request: EngineCoreRequest) -> None:
        rank = self._pick(request)
        self.clients[rank].add_request(request)  # raises before anything is recorded
        self._hold(request.request_id, rank)
        self._sent_since[rank] += 1

    def _hold(self, request_id: str, rank: int) -> None:
        old = self._rank_of.get(request_id)
        if old is not None:  # an id sent again (resumed after a pause) before its old final came
            self._open[old] -= 1
        self._rank_of[request_id] = rank
        self._open[rank] += 1

    def abort_requests(self, request_ids: list[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            if (rank := self._rank_of.get(rid)) is not None:
                by_rank.setdefault(rank, []).append(rid)
        for rank, ids in by_rank.items():
            self.clients[rank].abort_requests(ids)

    def _received(self, rank: int, outs: EngineCoreOutputs) -> EngineCoreOutputs:
        outs.engine_index = rank
        rank_of = self._rank_of
        for out in outs.outputs:
            if out.finish_reason is not None and rank_of.get(out.request_id) == rank:
                del rank_of[out.request_id]
                self._open[rank] -= 1
        if (stats := outs.scheduler_stats) is not None:
            self._published[rank] = WAITING_WEIGHT * stats.num_waiting_reqs + stats.num_running_reqs
            self._sent_since[rank] = 0
        return outs

    # ------------------------------------------------------------------ recovery
    def held_by(self, rank: int) -> list[str]:
        """The ids core `rank` holds: what a restart of it must resume (or drop)."""
        return [rid for rid, r in self._rank_of.items() if r == rank]

    def resubmit(self, requests: list[EngineCoreRequest], rank: int = 0) -> None:
        for rid in self.held_by(rank):
            del self._rank_of[rid]
        self._open[rank] = 0
        self._published[rank], self._sent_since[rank] = None, 0
        for request in requests:
            self._hold(request.request_id, rank)
        self.clients[rank].resubmit(requests)

    def shutdown(self, abort: list[str] | None = None) -> None:
        rank_of = getattr(self, "_rank_of", {})
        for rank, c in enumerate(self.clients):
            c.shutdown(abort=None if abort is None else [rid for rid in abort if rank_of.get(rid) == rank])
        if self._ray is not None:
            self._ray.shutdown()
            self._ray = None


class DPSyncClient(_DPClient[SyncMPClient]):
    """LLM's client over N cores: blocking waits over all their sockets, in POLL_MS slices."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, SyncMPClient)

    def get_output(self, timeout_s: float = 1.0) -> EngineCoreOutputs | None:
        """The next message of any core (each in turn, so none starves), or None after
        timeout_s. A lost core is replaced in its own client's read (SyncMPClient)."""
        deadline = Deadline(timeout_s)
        n = len(self.clients)
        while True:
            for i in range(n):
                rank = (self._turn + i) % n
                outs = self.clients[rank].get_output(0.0)
                if outs is not None:
                    self._turn = (rank + 1) % n
                    return self._received(rank, outs)
            self.supervisor.check()
            if deadline.expired():
                return None
            poller = zmq.Poller()
            for c in self.clients:
                if c.supervisor.live:
                    poller.register(c.sock, zmq.POLLIN)
            poller.poll(deadline.remaining_ms(POLL_MS))

    def call_utility(self, method: str, *args: Any) -> Any:
        return merge_utility(method, [c.call_utility(method, *args) for c in self.clients])

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")


class DPAsyncClient(_DPClient[AsyncMPClient]):
    """AsyncLLM's client over N cores: one reader (the output handler) over all their sockets."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, AsyncMPClient)

    async def get_output_async(self) -> EngineCoreOutputs:
        n = len(self.clients)
        while True:
            for i in range(n):
                rank = (self._turn + i) % n
                outs = self.clients[rank].try_get_output()
                if outs is not None:
                    self._turn = (rank + 1) % n
                    return self._received(rank, outs)
            self.supervisor.check()
            poller = zmq.asyncio.Poller()
            for c in self.clients:
                if c.supervisor.live:
                    poller.register(c.sock, zmq.POLLIN)
            await poller.poll(10 * POLL_MS)  # bounded: a lost core's socket leaves the set

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        results = await asyncio.gather(*(c.call_utility_async(method, *args) for c in self.clients))
        return merge_utility(method, list(results))

    def fail_pending_utilities(self, exc: BaseException) -> None:
        for c in self.clients:
            c.fail_pending_utilities(exc)
