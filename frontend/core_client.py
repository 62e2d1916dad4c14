"""Clients that carry EngineCoreRequests to an engine core and its outputs back (vLLM V1's
core_client.py).

* `InprocClient`: EngineCore in this process, called directly (debugging; LLM with
  TIDAL_ENABLE_MULTIPROCESSING=0 or `multiprocessing=False`).
* `SyncMPClient` (LLM) and `AsyncMPClient` (AsyncLLM): one DEALER socket with a unique identity,
  connected to a core this client spawned (ipc, see core_process.py) or to a headless core at
  `config.core_address`. Every message is [EngineCoreRequestType, msgpack payload...]; every
  reply is one EngineCoreOutputs. The constructor starts the core; `wait_ready()` does the
  handshake (utility "hello" -> ResolvedEngineInfo, or the core's start-up error).
* Death and restart (`client.supervisor`, frontend/supervisor.py): a lost core is replaced and
  the front-end resubmits its requests; past the restart budget the client is dead and every
  call raises EngineDeadError.
"""
from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any

import zmq
import zmq.asyncio

from tidal.frontend.core_connection import ABORT, ADD, POLL_MS, UTILITY, MPClientBase
from tidal.frontend.supervisor import CoreState
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
    decode_utility_result,
    encode_utility_result,
)
from tidal.utils.deadline import Deadline

logger = logging.getLogger(__name__)

UTILITY_TIMEOUT_S = 60.0


class InprocClient:
    """EngineCore in this process behind the same interface as SyncMPClient. Its requests carry
    no client identity (client_index None), so every output of a step is this client's."""

    def __init__(self, config: EngineConfig) -> None:
        from tidal.core.engine_core import EngineCore  # only this mode imports the core

        self.engine = EngineCore(config)
        self.info: ResolvedEngineInfo = self.engine.info

    def wait_ready(self) -> ResolvedEngineInfo:
        return self.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.engine.add_request(request)  # a rejection comes out of the next step

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine.abort_requests(request_ids)

    def get_output(self, timeout_s: float = 0.0) -> EngineCoreOutputs | None:
        """Runs one step; None when it had nothing to say."""
        return self.engine.step().get(None)

    def call_utility(self, method: str, *args: Any) -> Any:
        # Through the wire encoding, so that a result has the same types as from a core process.
        result = encode_utility_result(self.engine.call_utility(method, list(args)))
        return decode_utility_result(method, result)

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def shutdown(self, abort: list[str] | None = None) -> None:
        self.engine.shutdown()


class SyncMPClient(MPClientBase):
    """Blocking client for LLM: every wait polls in slices and re-checks for death. A lost core
    is replaced inside the wait that notices it (`_recover`)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, zmq.Context())
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.supervisor.check()
        frames = self._encode_request(request)
        if self.supervisor.live:  # else it goes with the resubmission
            self.sock.send_multipart(frames, copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.supervisor.live:
            self.sock.send_multipart(self._encode(ABORT, request_ids), copy=False)

    def before_replace(self) -> None:
        self._pending.clear()  # outputs of the lost core that nobody read are stale

    def _recover(self) -> None:
        """Replace the lost core (the supervisor resubmits); the ERROR outputs of the requests
        given up come out of the next get_output()."""
        if failed := self.supervisor.recover():
            self._pending.append(EngineCoreOutputs(outputs=failed))

    def get_output(self, timeout_s: float = 1.0) -> EngineCoreOutputs | None:
        """The next step's outputs, or None after timeout_s; EngineDeadError once dead."""
        deadline = Deadline(timeout_s)
        supervisor = self.supervisor
        while True:
            if supervisor.state is CoreState.LOST:
                self._recover()
            if self._pending:
                return self._pending.popleft()
            supervisor.check()
            if self.sock.poll(deadline.remaining_ms(POLL_MS)):
                outs = self._decode(self.sock.recv_multipart(copy=False))
                supervisor.check()
                if outs.utility_output is None and supervisor.live:
                    return outs
            elif deadline.expired():
                return None

    def call_utility(self, method: str, *args: Any, timeout_s: float = UTILITY_TIMEOUT_S) -> Any:
        supervisor = self.supervisor
        if supervisor.state is CoreState.LOST:
            self._recover()
        supervisor.check()
        call_id = next(self._call_ids)
        self.sock.send_multipart(self._encode(UTILITY, UtilityRequest(call_id, method, list(args))))
        deadline = Deadline(timeout_s)
        while not deadline.expired():
            supervisor.check()
            if not supervisor.live:
                raise RuntimeError(f"utility call {method!r} was interrupted: the engine core was lost "
                                   f"({supervisor.reason}) and is being restarted")
            if not self.sock.poll(POLL_MS):
                continue
            outs = self._decode(self.sock.recv_multipart(copy=False))
            supervisor.check()
            u = outs.utility_output
            if u is not None and u.call_id == call_id:
                return _utility_result(method, u)
            if outs.outputs:  # step outputs that came first wait for get_output()
                self._pending.append(outs)
        raise TimeoutError(f"utility call {method!r} got no answer within {timeout_s:g}s")

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")


class AsyncMPClient(MPClientBase):
    """asyncio client for AsyncLLM (zmq.asyncio socket). Sends never block (no high-water
    mark), so they also work from synchronous code in the loop's thread (generator cleanup)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, zmq.asyncio.Context())
        self._utility_futures: dict[int, asyncio.Future[Any]] = {}
        # A blocking view of the same socket, used only for non-blocking receives in the loop's
        # thread: a message that is already there skips the asyncio future machinery (which
        # costs more than decoding the message); the awaited path handles the rest.
        self._sync_view: zmq.Socket = zmq.Socket.shadow(self.sock.underlying)

    def _send(self, frames: list[Any]) -> None:
        self.supervisor.check()
        if not self.supervisor.live:
            return  # a request goes with the resubmission; an abort's request is not in it
        fut = self.sock.send_multipart(frames, copy=False)
        if fut.done():
            if (exc := fut.exception()) is not None:
                raise exc
        else:  # only if the socket ever pushed back; then report a late failure
            fut.add_done_callback(_log_send_failure)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(self._encode_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.supervisor.error is None:
            self._send(self._encode(ABORT, request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message with step outputs; utility replies are dispatched on the way.
        Raises EngineDeadError on an engine_dead message."""
        while True:
            try:
                frames = self._sync_view.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                frames = await self.sock.recv_multipart(copy=False)
            if (outs := self._take(frames)) is not None:
                return outs

    def try_get_output(self) -> EngineCoreOutputs | None:
        """`get_output_async` without waiting: the next message with step outputs that is
        already here, else None (data parallelism reads several cores this way)."""
        while True:
            try:
                frames = self._sync_view.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return None
            if (outs := self._take(frames)) is not None:
                return outs

    def _take(self, frames: list[Any]) -> EngineCoreOutputs | None:
        """Decode one message: a utility reply is dispatched (None when that was all of it)."""
        outs = self._decode(frames)
        self.supervisor.check()
        u = outs.utility_output
        if u is not None:
            self._resolve_utility(u)
            if not outs.outputs:
                return None
        return outs

    def _resolve_utility(self, u: UtilityOutput) -> None:
        fut = self._utility_futures.pop(u.call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(u)

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout_s: float = UTILITY_TIMEOUT_S) -> Any:
        """Needs the caller's output handler to be reading (AsyncLLM makes sure of it, and
        waits out a core restart first)."""
        if not self.supervisor.live:
            raise RuntimeError(f"utility call {method!r}: the engine core is being restarted")
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityOutput] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = fut
        try:
            self._send(self._encode(UTILITY, UtilityRequest(call_id, method, list(args))))
            u = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)
        return _utility_result(method, u)

    def before_replace(self) -> None:
        """In the loop's thread, once the output handler stopped: pending utility calls fail,
        and the lost core's socket goes (closing an asyncio socket elsewhere would race the
        loop's own use of it)."""
        self.fail_pending_utilities(RuntimeError("the utility call was interrupted: the engine core was lost "
                                                 f"({self.supervisor.reason}) and is being restarted"))
        self._close_socket()

    def after_replace(self) -> None:
        """In the loop's thread, after `replace_core()` ran in another: the blocking view for
        fast receives follows the new socket."""
        self._sync_view = zmq.Socket.shadow(self.sock.underlying)

    def fail_pending_utilities(self, exc: BaseException) -> None:
        for fut in self._utility_futures.values():
            if not fut.done():
                fut.set_exception(exc)
        self._utility_futures.clear()


def _utility_result(method: str, u: UtilityOutput) -> Any:
    if u.failure is not None:
        raise RuntimeError(f"utility {method!r} failed in the engine core: {u.failure}")
    return decode_utility_result(method, u.result)


def _log_send_failure(fut: "asyncio.Future[Any]") -> None:
    if not fut.cancelled() and fut.exception() is not None:
        logger.error("sending to the engine core failed: %s", fut.exception())

