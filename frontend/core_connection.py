"""The connection to an engine core that both socket clients share (core_client.py): the core
process it spawned or the headless core it reaches, its DEALER socket, the handshake, the
watcher that reports a death, and the mechanics of replacing a core that died.

Death and restart are the business of the connection's `supervisor` (frontend/supervisor.py):
a `CoreWatcher` thread (process exit / connection drop) or an `engine_dead` message reports the
core gone to it, and it drives the replacement through `replace_core()`. Sends go to the core
only while it is LIVE; once DEAD every call raises EngineDeadError.
"""
from __future__ import annotations

import itertools
import logging
import uuid
from typing import Any

import msgspec
import zmq

from tidal.frontend.core_process import CoreProcess, CoreWatcher
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.frontend.supervisor import CoreSupervisor
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HELLO,
    UtilityRequest,
    decode_utility_result,
)
from tidal.utils.curve import HANDSHAKE_REFUSED, HandshakeWatch, client_curve_options
from tidal.utils.deadline import Deadline
from tidal.utils.zmq_utils import MAX_MESSAGE_BYTES, Heartbeat, make_socket

logger = logging.getLogger(__name__)

ADD, ABORT, UTILITY = (t.value for t in EngineCoreRequestType)
POLL_MS = 100  # longest single wait; every loop around a wait re-checks death and deadlines


class MPClientBase:
    """What both socket clients share: the core process, the DEALER, the watcher, the handshake,
    and the replacement of a core that died (`replace_core`, driven by `supervisor`)."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context) -> None:
        self.config = config
        self.ctx = ctx
        self.process: CoreProcess | None = None
        self.watcher: CoreWatcher | None = None
        self.supervisor = CoreSupervisor(config, self)  # this core's state: live, lost, ...
        self.info: ResolvedEngineInfo | None = None
        self._linger_ms = 0
        self._encoder = MsgpackEncoder()
        self._decoder = MsgpackDecoder(EngineCoreOutputs)
        self._call_ids = itertools.count(1)
        try:
            self._open()
        except BaseException:
            self._teardown()
            raise

    def _open(self) -> None:
        """Start a core (none at core_address) and connect a DEALER with a fresh identity: a
        new core, or a headless one that may still hold the old identity's requests."""
        if self.config.core_address is None:
            self.process = CoreProcess(self.config)
            self.address = self.process.address
        else:
            self.address = self.config.core_address
        self.identity = b"tidal-fe-" + uuid.uuid4().bytes
        curve = client_curve_options(self.config)  # a keyed headless core
        self._handshake_watch: HandshakeWatch | None = None

        def watch(sock: zmq.Socket) -> None:  # a headless core may refuse this front-end's key
            self._handshake_watch = HandshakeWatch(self.ctx, sock, keyed=curve is not None)

        # ZMTP heartbeats drop the connection to a core whose process or host froze or
        # vanished; the watcher turns that into a lost core (restart) or EngineDeadError.
        self.sock = make_socket(self.ctx, self.address, zmq.DEALER, bind=False, identity=self.identity,
                                heartbeat=Heartbeat(self.config.heartbeat_timeout_s), curve=curve,
                                before_connect=watch if self.config.core_address is not None else None)

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
        self.watcher = CoreWatcher(self.ctx, self.sock, self.process, self.supervisor.core_gone)
        return self.info

    def _handshake(self, sock: zmq.Socket, timeout_s: float | None = None) -> ResolvedEngineInfo:
        watch, self._handshake_watch = self._handshake_watch, None
        try:
            return self._await_hello(sock, timeout_s, watch)
        finally:
            if watch is not None:  # before the core watcher puts its own monitor on the socket
                watch.close(sock)

    def _await_hello(self, sock: zmq.Socket, timeout_s: float | None, watch: HandshakeWatch | None
                     ) -> ResolvedEngineInfo:
        call_id = next(self._call_ids)
        try:  # never blocks: see curve.HANDSHAKE_REFUSED
            sock.send_multipart([UTILITY, *self._encoder.encode(UtilityRequest(call_id, HELLO))], zmq.NOBLOCK)
        except zmq.Again:  # the handshake failed already: its event says which key is wrong
            problem = watch.problem(wait_s=0.5) if watch is not None else None
            raise RuntimeError(f"engine core failed to start: the core at {self.address} "
                               f"{problem or HANDSHAKE_REFUSED}") from None
        if timeout_s is None:
            timeout_s = self.config.engine_start_timeout_s
        deadline = Deadline(timeout_s)
        while True:
            if sock.poll(POLL_MS):
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
            if watch is not None and (problem := watch.problem()) is not None:
                raise RuntimeError(f"engine core failed to start: the core at {self.address} {problem}")
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"engine core failed to start: {self.process.startup_error()}")
            if self.supervisor.error is not None:  # shutdown() during a restart's handshake
                raise RuntimeError("the engine was shut down")
            if deadline.expired():
                raise RuntimeError(
                    f"engine core failed to start: no handshake from {self.address} within "
                    f"{timeout_s:g}s (engine_start_timeout_s)")

    # ---------------------------------------------------------------- replacement (CoreLink)
    def before_replace(self) -> None:
        """In the recovering thread, before `replace_core` (subclasses drop what is stale)."""

    def after_replace(self) -> None:
        """In the recovering thread, once the new core answered."""

    def replace_core(self) -> ResolvedEngineInfo:
        """Stop what is left of the lost core, start (or reach) a new one and handshake (the
        supervisor makes sure no other thread uses the socket meanwhile). The new core must
        have the old one's limits, which the front-end's checks were built on."""
        self._close_socket()  # first: its monitor goes before the watcher's end of it (see there)
        if self.watcher is not None:
            self.watcher.stop()
            self.watcher = None
        if self.process is not None:
            self.process.shutdown(grace_s=1.0)  # one that failed on purpose is exiting anyway
        self._open()
        timeout_s = (self.config.engine_start_timeout_s if self.process is not None
                     else self.config.core_reconnect_timeout_s)
        info = self._handshake(zmq.Socket.shadow(self.sock.underlying), timeout_s)
        if self.info is not None and (info.max_model_len, info.vocab_size) != (
                self.info.max_model_len, self.info.vocab_size):
            raise RuntimeError(f"the new engine core has other limits ({info}) than the lost one ({self.info})")
        self.info = info
        self.watcher = CoreWatcher(self.ctx, self.sock, self.process, self.supervisor.core_gone)
        logger.warning("engine core at %s answered", self.address)
        return info

    @property
    def supervisors(self) -> list[CoreSupervisor]:
        """One per core (data parallelism has several: dp_client.py)."""
        return [self.supervisor]

    def held_by(self, rank: int) -> list[str] | None:
        """The requests core `rank` holds; None: this client's one core holds them all."""
        return None

    def resubmit(self, requests: list[EngineCoreRequest], rank: int = 0) -> None:
        """Send the front-end's resumed requests to the new core (while RECONNECTING, when
        every other send is dropped)."""
        for request in requests:
            self.sock.send_multipart(self._encode(ADD, request), copy=False)

    def _decode(self, frames: list[Any]) -> EngineCoreOutputs:
        outs = self._decoder.decode(frames)
        if outs.engine_dead is not None:
            self.supervisor.core_gone(outs.engine_dead, failed_step_request_ids=outs.failed_step_request_ids)
        return outs

    def _encode(self, kind: bytes, obj: Any) -> list[Any]:
        return [kind, *self._encoder.encode(obj)]

    def _encode_request(self, request: EngineCoreRequest) -> list[Any]:
        """A new request's ADD message. ValueError, with nothing sent, past what a core accepts:
        libzmq would drop the connection instead, which reads as a lost core (a restart for
        everyone, and the same request sent again)."""
        frames = self._encode(ADD, request)
        size = sum(memoryview(frame).nbytes for frame in frames)
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"the request is {size} bytes encoded, more than the {MAX_MESSAGE_BYTES} bytes an "
                             "engine core accepts in one message (its prompt, stop strings, token-id lists and "
                             "logit_bias make it up)")
        return frames

    # ---------------------------------------------------------------- shutdown
    def shutdown(self, abort: list[str] | None = None) -> None:
        """Stop watching, close the socket, stop a spawned core. `abort`: request ids to abort
        first in a headless core (which outlives this front-end)."""
        if self.ctx.closed:  # shut down already (or torn down by a failed start)
            return
        was_live = self.supervisor.live
        # DEAD from here on: a restart in flight sees it within one poll slice and gives up
        # (the supervisor waits for that), so its new core does not outlive this shutdown.
        self.supervisor.shutdown()
        if abort and self.process is None and was_live:
            try:
                frames = self._encode(ABORT, abort)
                zmq.Socket.shadow(self.sock.underlying).send_multipart(frames, zmq.NOBLOCK)
                self._linger_ms = 1_000  # let the abort reach the core before the socket goes
            except zmq.ZMQError:
                pass
        self._teardown()

    def _close_socket(self) -> None:
        """Close the DEALER, its monitor first. libzmq sends monitor events with a blocking send
        from its IO thread: an event (a DISCONNECTED as the old core goes) for a monitor whose
        reader, the watcher, has closed its end blocks that thread for good, and with it every
        socket of this context -- a replacement core's handshake then never gets through."""
        sock = getattr(self, "sock", None)
        if sock is not None and not sock.closed:
            try:
                sock.disable_monitor()
            except zmq.ZMQError:
                pass
            try:
                sock.close(linger=self._linger_ms)
            except Exception:  # e.g. an asyncio socket whose loop is closed already
                zmq.Socket.shadow(sock.underlying).close(linger=self._linger_ms)

    def _teardown(self) -> None:
        self._close_socket()  # before the watcher stops (see _close_socket)
        if self.watcher is not None:
            self.watcher.stop()
        if self.process is not None:
            self.process.shutdown()
        self.ctx.destroy(linger=self._linger_ms)
