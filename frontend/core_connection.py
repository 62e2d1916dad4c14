"""The connection to an engine core that both socket clients share (core_client.py): the core
process it spawned or the headless core it reaches, its DEALER socket, the handshake, the
watcher that reports a death, and the restart of a core that died.

Death and restart: a `CoreWatcher` thread (process exit / connection drop) or an `engine_dead`
message reports the core gone. While restarts are left (`max_core_restarts` within
CORE_RESTART_WINDOW_S) the core is only `lost`: the front-end calls `reconnect()` (a new core,
or the headless one again on its address) and resubmits its requests, resuming every stream.
Otherwise the client is dead: from then on every call raises EngineDeadError.
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
import uuid
from typing import Any, Callable

import msgspec
import zmq

from tidal.frontend.core_process import CoreProcess, CoreWatcher
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.config import CORE_RESTART_WINDOW_S, EngineConfig, ResolvedEngineInfo
from tidal.protocol.curve import HANDSHAKE_REFUSED, client_curve_options
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HELLO,
    UtilityRequest,
    decode_utility_result,
)
from tidal.protocol.utils import Deadline, summarize_exception
from tidal.protocol.zmq_utils import MAX_MESSAGE_BYTES, Heartbeat, make_socket

logger = logging.getLogger(__name__)

ADD, ABORT, UTILITY = (t.value for t in EngineCoreRequestType)
POLL_MS = 100  # longest single wait; every loop around a wait re-checks death and deadlines


class MPClientBase:
    """What both socket clients share: the core process, the DEALER, the watcher, the handshake,
    and the restart of a core that died (see `mark_dead` and `reconnect`)."""

    def __init__(self, config: EngineConfig, ctx: zmq.Context) -> None:
        self.config = config
        self.ctx = ctx
        self.process: CoreProcess | None = None
        self.watcher: CoreWatcher | None = None
        self.dead: EngineDeadError | None = None
        # Why the core was lost, from the moment it is noticed until `reconnect()` brought a
        # new one and the front-end resubmitted its requests; sends are dropped meanwhile
        # (their requests are registered in the front-end and go with the resubmission).
        self.lost: str | None = None
        # With `lost`: the front-end's requests that were in the step that failed (the lost
        # core's engine_dead said so); None when unknown (e.g. the process just vanished).
        self.failed_step_request_ids: list[str] | None = None
        self.num_restarts = 0
        self.resumable = False  # the front-end resubmits its requests after a restart (it sets this)
        # Set when the application began to shut down (tidal serve, at its SIGTERM/SIGINT), before
        # it stops the core: a core that goes from then on is part of that shutdown, never a
        # crash to restart in the middle of it.
        self.shutting_down = False
        self._reconnecting = threading.Lock()  # shutdown() waits for a reconnect() in flight
        self._restart_times: collections.deque[float] = collections.deque()
        self.info: ResolvedEngineInfo | None = None
        self._on_dead_callbacks: list[Callable[[EngineDeadError], None]] = []
        self._on_lost_callbacks: list[Callable[[str], None]] = []
        self._closed = False
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
        # ZMTP heartbeats drop the connection to a core whose process or host froze or
        # vanished; the watcher turns that into a lost core (restart) or EngineDeadError.
        self.sock = make_socket(self.ctx, self.address, zmq.DEALER, bind=False, identity=self.identity,
                                heartbeat=Heartbeat(self.config.heartbeat_timeout_s),
                                curve=client_curve_options(self.config))  # a keyed headless core

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

    def _handshake(self, sock: zmq.Socket, timeout_s: float | None = None) -> ResolvedEngineInfo:
        call_id = next(self._call_ids)
        try:  # never blocks: see curve.HANDSHAKE_REFUSED
            sock.send_multipart([UTILITY, *self._encoder.encode(UtilityRequest(call_id, HELLO))], zmq.NOBLOCK)
        except zmq.Again:
            raise RuntimeError(f"engine core failed to start: {self.address} {HANDSHAKE_REFUSED}") from None
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
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"engine core failed to start: {self.process.startup_error()}")
            if self._closed:  # shutdown() during a restart's handshake
                raise RuntimeError("the engine was shut down")
            if deadline.expired():
                raise RuntimeError(
                    f"engine core failed to start: no handshake from {self.address} within "
                    f"{timeout_s:g}s (engine_start_timeout_s)")

    # ---------------------------------------------------------------- death
    def add_dead_callback(self, fn: Callable[[EngineDeadError], None]) -> None:
        self._on_dead_callbacks.append(fn)

    def add_lost_callback(self, fn: Callable[[str], None]) -> None:
        """`fn(reason)` runs (in the thread that noticed) when the core is lost and a restart
        is due; the front-end then calls `reconnect()` and resubmits its requests."""
        self._on_lost_callbacks.append(fn)

    def mark_dead(self, reason: str, restartable: bool = True,
                  failed_step_request_ids: list[str] | None = None) -> None:
        """From the watcher thread, or from the reader on an engine_dead message: the core is
        gone. While restarts are left (max_core_restarts within CORE_RESTART_WINDOW_S; a
        headless core: core_reconnect_timeout_s > 0) it is only lost; else, or when not
        `restartable` (a failure of this front-end's own), the engine is dead. Idempotent.
        failed_step_request_ids: what the engine_dead message said (None: unknown)."""
        if self.dead is not None or self._closed or self.lost is not None:
            return
        if restartable and not self.shutting_down and self._restart_allowed():
            self.failed_step_request_ids = failed_step_request_ids
            self.lost = reason
            logger.error("engine core lost: %s; restarting it and resuming its requests "
                         "(restart %d of at most %d within %gs)", reason, len(self._restart_times) + 1,
                         self.config.max_core_restarts, CORE_RESTART_WINDOW_S)
            for lost_fn in self._on_lost_callbacks:
                lost_fn(reason)
            return
        self._set_dead(EngineDeadError(f"Engine core is dead: {reason}"))

    def _set_dead(self, exc: EngineDeadError) -> None:
        self.dead = exc
        for fn in self._on_dead_callbacks:
            fn(exc)

    def _restart_allowed(self) -> bool:
        if not self.resumable or self.config.max_core_restarts <= 0:
            return False
        if self.config.core_address is not None and self.config.core_reconnect_timeout_s <= 0:
            return False
        times, now = self._restart_times, time.monotonic()
        while times and now - times[0] > CORE_RESTART_WINDOW_S:
            times.popleft()
        return len(times) < self.config.max_core_restarts

    def reconnect(self) -> ResolvedEngineInfo:
        """Replace a lost core (blocking; the caller makes sure no other thread uses the socket
        meanwhile): stop the old one, start a new one (a headless core: wait up to
        core_reconnect_timeout_s for one to answer on the same address), handshake. The new
        core must have the old one's limits, which the front-end's checks were built on.
        Failure: the engine is dead (EngineDeadError, also to the dead callbacks)."""
        assert self.lost is not None, "reconnect() is for a lost core"
        with self._reconnecting:
            if self._closed:
                raise EngineDeadError("the engine was shut down")
            return self._reconnect()

    def _reconnect(self) -> ResolvedEngineInfo:
        while True:
            self._restart_times.append(time.monotonic())
            self.num_restarts += 1
            try:
                info = self._start_replacement()
                break
            except BaseException as e:
                reason = f"restarting it failed: {summarize_exception(e)}"
                # A spawned replacement that died while starting (killed, say) counts as one
                # more restart, while any are left; a headless core had its whole window.
                if (self.process is None or self._closed or not isinstance(e, Exception)
                        or not self._restart_allowed()):
                    exc = EngineDeadError(f"Engine core is dead: {self.lost}; {reason}")
                    logger.error("%s", exc)
                    self.lost = None
                    self._set_dead(exc)
                    raise exc from None
                logger.error("engine core lost again while starting (%s); trying once more", reason)
        self.info = info
        self.watcher = CoreWatcher(self.ctx, self.sock, self.process, self.mark_dead)
        logger.warning("engine core restarted at %s (%d restart(s) so far)", self.address, self.num_restarts)
        return info

    def _start_replacement(self) -> ResolvedEngineInfo:
        """Stop what is left of the lost core, start (or reach) a new one and handshake."""
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
        return info

    def resubmit(self, requests: list[EngineCoreRequest]) -> None:
        """Send the front-end's resumed requests to the new core (while still `lost`)."""
        for request in requests:
            self.sock.send_multipart(self._encode(ADD, request), copy=False)

    def resumed(self) -> None:
        """The front-end resubmitted its requests to the new core: sends go through again."""
        self.lost = None

    def resume_failed(self, reason: str) -> None:
        """The front-end could not resume its requests on the new core: the engine is dead (its
        dead callbacks end every stream; mark_dead alone ignores a core still `lost`)."""
        self.lost = None
        self.mark_dead(reason, restartable=False)

    def check_dead(self) -> None:
        if self.dead is not None:
            raise self.dead
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    def _decode(self, frames: list[Any]) -> EngineCoreOutputs:
        outs = self._decoder.decode(frames)
        if outs.engine_dead is not None:
            if self.lost is not None and self.failed_step_request_ids is None:
                # The watcher saw the process go first: the core's last word still counts.
                self.failed_step_request_ids = outs.failed_step_request_ids
            self.mark_dead(outs.engine_dead, failed_step_request_ids=outs.failed_step_request_ids)
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
        if self._closed:
            return
        self._closed = True
        # A restart in flight sees _closed within one poll slice and gives up; its new core
        # must not outlive this shutdown.
        if not self._reconnecting.acquire(timeout=10.0):
            logger.warning("a core restart did not stop within 10 s of shutdown")
        else:
            self._reconnecting.release()
        if abort and self.process is None and self.dead is None and self.lost is None:
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
