"""Clients that carry EngineCoreRequests to an engine core and its outputs back (vLLM V1's
core_client.py).

* `InprocClient`: EngineCore in this process, called directly (debugging; LLM with
  TIDAL_ENABLE_MULTIPROCESSING=0 or `multiprocessing=False`).
* `SyncMPClient` (LLM) and `AsyncMPClient` (AsyncLLM): one DEALER socket with a unique identity,
  connected to a core this client spawned (ipc, see core_process.py) or to a headless core at
  `config.core_address`. Every message is [EngineCoreRequestType, msgpack payload...]; every
  reply is one EngineCoreOutputs. The constructor starts the core; `wait_ready()` does the
  handshake (utility "hello" -> ResolvedEngineInfo, or the core's start-up error).
* Death: a `CoreWatcher` thread (process exit / connection drop) or an `engine_dead` message
  marks the client dead; from then on every call raises EngineDeadError.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import uuid
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from tidal.frontend.core_process import CoreProcess, CoreWatcher
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HELLO,
    SchedulerStats,
    UtilityOutput,
    UtilityRequest,
    decode_utility_result,
    encode_utility_result,
)
from tidal.protocol.utils import Deadline
from tidal.protocol.zmq_utils import Heartbeat, make_socket

logger = logging.getLogger(__name__)

_ADD, _ABORT, _UTILITY = (t.value for t in EngineCoreRequestType)
_POLL_MS = 100  # longest single wait; every loop around a wait re-checks death and deadlines
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


class _MPClientBase:
    """What both socket clients share: the core process, the DEALER, the watcher, the handshake."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context) -> None:
        self.config = config
        self.ctx = ctx
        self.process: CoreProcess | None = None
        self.watcher: CoreWatcher | None = None
        self.dead: EngineDeadError | None = None
        self.info: ResolvedEngineInfo | None = None
        self._on_dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._closed = False
        self._linger_ms = 0
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._call_ids = itertools.count(1)
        self.identity = b"tidal-fe-" + uuid.uuid4().bytes
        try:
            if config.core_address is None:
                self.process = CoreProcess(config)
                self.address = self.process.address
            else:
                self.address = config.core_address
            # ZMTP heartbeats drop the connection to a core whose process or host froze or
            # vanished; the watcher turns that into EngineDeadError for every stream.
            self.sock = make_socket(ctx, self.address, zmq.DEALER, bind=False, identity=self.identity,
                                    heartbeat=Heartbeat(config.heartbeat_timeout_s))
        except BaseException:
            self._teardown()
            raise

    # ---------------------------------------------------------------- handshake
    def wait_ready(self) -> ResolvedEngineInfo:
        """Handshake with the core; RuntimeError('engine core failed to start: ...') if it fails
        or stays silent for engine_start_timeout_s. Uses a blocking view of the socket, so it
        works in a constructor even inside a running event loop."""
        if self.info is not None:
            return self.info
        try:
            self.info = self._handshake(zmq.Socket.shadow(self.sock.underlying))
        except BaseException:
            self._teardown()
            raise
        self.watcher = CoreWatcher(self.ctx, self.sock, self.process, self.mark_dead)
        return self.info

    def _handshake(self, sock: zmq.Socket) -> ResolvedEngineInfo:
        call_id = next(self._call_ids)
        sock.send_multipart([_UTILITY, *self._encoder.encode(UtilityRequest(call_id, HELLO))])
        timeout_s = self.config.engine_start_timeout_s
        deadline = Deadline(timeout_s)
        while True:
            if sock.poll(_POLL_MS):
                try:
                    outs = self._decoder.decode(sock.recv_multipart())
                except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                    raise RuntimeError(f"engine core failed to start: {self.address} answered "
                                       f"with something that is not a tidal engine core ({e})") from None
                u = outs.utility_output
                if outs.engine_dead:
                    raise RuntimeError(f"engine core failed to start: {outs.engine_dead}")
                if u is not None and u.call_id == call_id:
                    if u.failure is not None:
                        raise RuntimeError(f"engine core failed to start: {u.failure}")
                    try:
                        info: ResolvedEngineInfo = decode_utility_result(HELLO, u.result)
                    except (msgspec.DecodeError, msgspec.ValidationError) as e:
                        raise RuntimeError(f"engine core failed to start: {self.address} answered "
                                           f"with an engine description this front-end cannot "
                                           f"read ({e})") from None
                    return info
                continue
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"engine core failed to start: {self.process.startup_error()}")
            if deadline.expired():
                raise RuntimeError(
                    f"engine core failed to start: no handshake from {self.address} within "
                    f"{timeout_s:g}s (engine_start_timeout_s)")

    # ---------------------------------------------------------------- death
    def add_dead_callback(self, fn: Callable[[EngineDeadError], None]) -> None:
        self._on_dead_callbacks.append(fn)

    def mark_dead(self, reason: str) -> None:
        """From the watcher thread, or from the reader on an engine_dead message. Idempotent."""
        if self.dead is not None or self._closed:
            return
        self.dead = EngineDeadError(f"Engine core is dead: {reason}")
        for fn in self._on_dead_callbacks:
            fn(self.dead)

    def check_dead(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    def _decode(self, frames: list[Any]) -> EngineCoreOutputs:
        outs = self._decoder.decode(frames)
        if outs.engine_dead is not None:
            self.mark_dead(outs.engine_dead)
        return outs

    def _encode(self, kind: bytes, obj: Any) -> list[Any]:
        return [kind, *self._encoder.encode(obj)]

    # ---------------------------------------------------------------- shutdown
    def shutdown(self, abort: list[str] | None = None) -> None:
        """Stop watching, close the socket, stop a spawned core. `abort`: request ids to abort
        first in a headless core (which outlives this front-end)."""
        if self._closed:
            return
        self._closed = True
        if abort and self.process is None and self.dead is None:
            try:
                frames = self._encode(_ABORT, abort)
                zmq.Socket.shadow(self.sock.underlying).send_multipart(frames, zmq.NOBLOCK)
                self._linger_ms = 1_000  # let the abort reach the core before the socket goes
            except zmq.ZMQError:
                pass
        self._teardown()

    def _teardown(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.close(linger=self._linger_ms)
            except Exception:  # e.g. an asyncio socket whose loop is closed already
                zmq.Socket.shadow(sock.underlying).close(linger=self._linger_ms)
        if self.process is not None:
            self.process.shutdown()
        self.ctx.destroy(linger=self._linger_ms)


class SyncMPClient(_MPClientBase):
    """Blocking client for LLM: every wait polls in slices and re-checks for death."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, zmq.Context())
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.check_dead()
        self.sock.send_multipart(self._encode(_ADD, request), copy=False)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None and not self._closed:
            self.sock.send_multipart(self._encode(_ABORT, request_ids), copy=False)

    def get_output(self, timeout_s: float = 1.0) -> EngineCoreOutputs | None:
        """The next step's outputs, or None after timeout_s; EngineDeadError once dead."""
        if self._pending:
            return self._pending.popleft()
        deadline = Deadline(timeout_s)
        while True:
            self.check_dead()
            if self.sock.poll(deadline.remaining_ms(_POLL_MS)):
                outs = self._decode(self.sock.recv_multipart(copy=False))
                self.check_dead()
                if outs.utility_output is None:
                    return outs
            elif deadline.expired():
                return None

    def call_utility(self, method: str, *args: Any, timeout_s: float = UTILITY_TIMEOUT_S) -> Any:
        self.check_dead()
        call_id = next(self._call_ids)
        self.sock.send_multipart(self._encode(_UTILITY, UtilityRequest(call_id, method, list(args))))
        deadline = Deadline(timeout_s)
        while not deadline.expired():
            self.check_dead()
            if not self.sock.poll(_POLL_MS):
                continue
            outs = self._decode(self.sock.recv_multipart(copy=False))
            self.check_dead()
            u = outs.utility_output
            if u is not None and u.call_id == call_id:
                return _utility_result(method, u)
            if outs.outputs:  # step outputs that came first wait for get_output()
                self._pending.append(outs)
        raise TimeoutError(f"utility call {method!r} got no answer within {timeout_s:g}s")

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")


class AsyncMPClient(_MPClientBase):
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
        self.check_dead()
        fut = self.sock.send_multipart(frames, copy=False)
        if fut.done():
            if (exc := fut.exception()) is not None:
                raise exc
        else:  # only if the socket ever pushed back; then report a late failure
            fut.add_done_callback(_log_send_failure)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(self._encode(_ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead is None and not self._closed:
            self._send(self._encode(_ABORT, request_ids))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message with step outputs; utility replies are dispatched on the way.
        Raises EngineDeadError on an engine_dead message."""
        while True:
            try:
                frames = self._sync_view.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                frames = await self.sock.recv_multipart(copy=False)
            outs = self._decode(frames)
            if self.dead is not None:
                raise self.dead
            u = outs.utility_output
            if u is not None:
                self._resolve_utility(u)
                if not outs.outputs:
                    continue
            return outs

    def _resolve_utility(self, u: UtilityOutput) -> None:
        fut = self._utility_futures.pop(u.call_id, None)
        if fut is not None and not fut.done():
            fut.set_result(u)

    async def call_utility_async(self, method: str, *args: Any,
                                 timeout_s: float = UTILITY_TIMEOUT_S) -> Any:
        """Needs the caller's output handler to be reading (AsyncLLM makes sure of it)."""
        call_id = next(self._call_ids)
        fut: asyncio.Future[UtilityOutput] = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = fut
        try:
            self._send(self._encode(_UTILITY, UtilityRequest(call_id, method, list(args))))
            u = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._utility_futures.pop(call_id, None)
        return _utility_result(method, u)

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

