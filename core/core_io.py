"""The engine-core process's socket side: one ROUTER socket, an IO thread and an output thread.

Threads and sockets (a ZMQ socket is only ever used by one thread):

    front-ends (DEALER) ──▶ ROUTER ─ IO thread: recv + typed decode ─▶ input queue ─▶ busy loop
    front-ends (DEALER) ◀── ROUTER ◀─ IO thread ◀─ inproc PULL ◀─ output thread: encode ◀─ output queue

* The IO thread owns the ROUTER (bound at the core's address) and the inproc PULL; it never
  runs engine code, so requests are decoded while the busy loop steps.
* The output thread owns the inproc PUSH and does the msgpack encoding off the busy loop.
* The ROUTER is ROUTER_MANDATORY: a send to a front-end whose connection is gone fails with
  EHOSTUNREACH, which is how the core learns that a front-end disconnected (libzmq 4.3 without
  draft APIs has no ROUTER_NOTIFY). The busy loop then aborts that front-end's requests.
* Garbage (a wrong frame count, unknown request type, undecodable payload, nesting past the
  decoder's cap: any exception while decoding) is logged and dropped; a frame over
  MAX_MESSAGE_BYTES makes libzmq drop its sender's connection before anything is read.
* ZMTP heartbeats (set before bind, see zmq_utils.Heartbeat): a front-end whose host froze or
  vanished without a FIN loses its connection within `heartbeat_timeout_s`, and the next
  output for it fails with EHOSTUNREACH like any disconnect.
* CURVE (a headless core with a key file, see tidal_pkg/utils/curve.py): the ROUTER is a CURVE
  server and a ZAP handler thread admits only the key file's client key; a front-end without
  it never gets a message through. Binding off loopback without a key file is refused.
* Back-pressure: `send()` blocks while _MAX_IN_FLIGHT messages are between the busy loop and the
  ROUTER. A busy loop that never blocks (null runner, tiny batches) would otherwise hold the
  GIL so that the helper threads get one socket call per GIL switch interval (5 ms): outputs
  pile up unboundedly and reach front-ends seconds late, and so do their aborts. Blocking
  hands the GIL over deterministically; with a real model the forward pass releases the GIL
  and the helpers overlap it, as intended.
"""
from __future__ import annotations

import errno
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Sequence

import zmq

from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    FinishReason,
    UtilityRequest,
)
from tidal.utils.curve import check_bind_security, load_key_file, server_curve, start_authenticator
from tidal.utils.zmq_utils import MAX_MESSAGE_BYTES, Heartbeat, make_socket, validate_address

if TYPE_CHECKING:
    from zmq.auth.thread import ThreadAuthenticator

logger = logging.getLogger(__name__)

# Kinds of items the IO thread puts on the input queue (besides the three request types).
GONE = b"gone"  # (GONE, identity, None): that front-end's connection is gone

InputItem = tuple[bytes, bytes, Any]  # (kind, front-end identity, decoded payload)

_STOP = b""  # a one-frame message on the inproc pipe: flush and close
_MAX_BURST = 256  # messages handled per socket per poll round, so neither side starves
_MAX_IN_FLIGHT = 2  # step messages encoded or queued but not yet handed to the ROUTER


def _leading_request_id(payload: bytes) -> str | None:
    """The first field of an EngineCoreRequest (an array whose first item is a str), read from
    the raw bytes: enough to answer a malformed ADD, without decoding (or skipping) the rest,
    which may be what is malformed."""
    view = memoryview(payload)
    if not view:
        return None
    # msgpack array headers: fixarray (1 byte, non-empty), array 16 (3 bytes), array 32 (5).
    head = 1 if 0x91 <= view[0] <= 0x9f else {0xdc: 3, 0xdd: 5}.get(view[0], 0)
    if not head or len(view) <= head:
        return None
    tag, body = view[head], view[head + 1:]
    if 0xa0 <= tag <= 0xbf:  # fixstr
        size, skip = tag - 0xa0, 0
    elif tag in (0xd9, 0xda, 0xdb):  # str 8 / 16 / 32
        skip = {0xd9: 1, 0xda: 2, 0xdb: 4}[tag]
        size = int.from_bytes(body[:skip], "big")
    else:
        return None
    raw = bytes(body[skip:skip + size])
    if len(raw) != size:
        return None
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return None


class CoreIO:
    """Binds the core's address and runs the IO and output threads.

    `send(identity, outputs)` may be called from the busy loop only; decoded input arrives on
    `input_queue`. `close()` delivers everything sent before it, then closes the sockets.
    """

    def __init__(self, address: str, input_queue: "queue.SimpleQueue[InputItem]", *,
                 heartbeat_timeout_s: float = 20.0, key_file: str | None = None) -> None:
        self.address = address
        self.input_queue = input_queue
        # Refused before anything starts: a wildcard (its own message), then a bind off
        # loopback without a key; a bad key file names its problem.
        check_bind_security(validate_address(address), key_file)
        key = None if key_file is None else load_key_file(key_file, server=True)
        self._ctx = zmq.Context()
        self._auth: ThreadAuthenticator | None = None
        try:
            if key is not None:  # the ZAP handler must be up before the first connection
                self._auth = start_authenticator(self._ctx, key)
            # Linger so that the last outputs (engine_dead, final tokens) reach the front-ends
            # after close(); bounded so that a stuck peer cannot hold the core forever.
            self._router = make_socket(self._ctx, address, zmq.ROUTER, bind=True, linger_ms=3_000,
                                       heartbeat=Heartbeat(heartbeat_timeout_s),
                                       max_message_bytes=MAX_MESSAGE_BYTES,
                                       curve=None if key is None else server_curve(key))
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            inproc = f"inproc://tidal-core-out-{id(self):x}"
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.bind(inproc)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.setsockopt(zmq.SNDHWM, 0)
            self._push.connect(inproc)
        except BaseException:
            self._stop_auth()
            self._ctx.destroy(linger=0)
            raise
        self._out_q: "queue.SimpleQueue[tuple[bytes, EngineCoreOutputs] | None]" = queue.SimpleQueue()
        self._in_flight = threading.Semaphore(_MAX_IN_FLIGHT)
        self._gone: set[bytes] = set()  # identities already reported GONE (IO thread only)
        self._num_garbage = 0
        self._closed = False
        # Sockets were created here and are handed to their threads: Thread.start() is a full
        # memory barrier, which is what ZMQ requires to migrate a socket between threads.
        self._io_thread = threading.Thread(target=self._io_loop, name="tidal-core-io", daemon=True)
        self._out_thread = threading.Thread(target=self._output_loop, name="tidal-core-out", daemon=True)
        self._io_thread.start()
        self._out_thread.start()

    # ---------------------------------------------------------------- busy-loop side
    def send(self, identity: bytes, outputs: EngineCoreOutputs) -> None:
        """Queue one message for `identity`; blocks while the pipeline is full (see above)."""
        while not self._in_flight.acquire(timeout=0.5):
            if not self._io_thread.is_alive():
                break  # nothing will free a slot; close() still delivers what it can
        self._out_q.put((identity, outputs))

    def flush(self, timeout_s: float = 0.1) -> bool:
        """Wait (at most `timeout_s`) until every message sent so far is in the ROUTER, whose
        libzmq thread writes it out without the GIL: a message flushed before a step survives
        the process being killed during that step. True when nothing is left in flight."""
        taken = 0
        deadline = time.monotonic() + timeout_s
        try:
            while taken < _MAX_IN_FLIGHT:
                if not self._in_flight.acquire(timeout=max(0.0, deadline - time.monotonic())):
                    return False
                taken += 1
            return True
        finally:
            if taken:
                self._in_flight.release(taken)

    def close(self, timeout_s: float = 5.0) -> None:
        """Deliver every queued output (within the ROUTER's linger), then close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._out_q.put(None)
        self._out_thread.join(timeout_s)
        self._io_thread.join(timeout_s)
        self._stop_auth()  # last: only new handshakes ask it, and the ROUTER is closed now
        self._ctx.destroy(linger=0)  # the ROUTER itself was closed with its linger in the IO thread

    def _stop_auth(self) -> None:
        if self._auth is not None:
            self._auth.stop()
            self._auth = None

    # ---------------------------------------------------------------- output thread
    def _output_loop(self) -> None:
        encoder = MsgpackEncoder()
        push = self._push
        try:
            while True:
                item = self._out_q.get()
                if item is None:
                    push.send(_STOP)
                    return
                identity, outputs = item
                try:
                    bufs = encoder.encode(outputs)
                except Exception:  # an unencodable object must not take the output path down
                    logger.exception("dropping an engine-core message that cannot be encoded")
                    self._in_flight.release()  # its slot: it never reaches the IO thread
                    continue
                push.send_multipart([identity, *bufs], copy=False)
        finally:
            push.close(linger=-1)  # inproc: everything pushed reaches the PULL side

    # ---------------------------------------------------------------- IO thread
    def _io_loop(self) -> None:
        router, pull = self._router, self._pull
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        decoders = _Decoders()
        try:
            while True:
                ready = dict(poller.poll())
                # Inputs first: the busy loop may be blocked in send() right now, which leaves
                # this thread the GIL until _forward_outputs frees a slot.
                if router in ready:
                    for _ in range(_MAX_BURST):
                        if not self._receive_one(router, decoders):
                            break
                if pull in ready and self._forward_outputs(router, pull):
                    return
        except Exception:
            # Only a programming error gets here; without this thread the core is deaf, so
            # tell the busy loop (it turns this into engine_dead for every front-end).
            logger.exception("engine-core IO thread failed")
            self.input_queue.put((b"io-dead", b"", "engine-core IO thread failed"))
        finally:
            router.close()  # with the linger set at creation: pending outputs still go out
            pull.close(linger=0)

    def _forward_outputs(self, router: zmq.Socket, pull: zmq.Socket) -> bool:
        """Pass encoded outputs to their front-ends; True once the STOP marker arrived."""
        done = 0
        try:
            for _ in range(_MAX_BURST):
                try:
                    frames = pull.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    return False
                if len(frames) == 1:
                    return True
                done += 1
                try:
                    router.send_multipart(frames, copy=False)
                except zmq.ZMQError as e:
                    if e.errno != errno.EHOSTUNREACH:
                        raise
                    identity = frames[0].bytes
                    if identity not in self._gone:
                        self._gone.add(identity)
                        self.input_queue.put((GONE, identity, None))
            return False
        finally:
            if done:
                self._in_flight.release(done)  # once per burst: one wake-up of the busy loop

    def _receive_one(self, router: zmq.Socket, decoders: "_Decoders") -> bool:
        """Receive and handle one message; False when none is waiting. A function of its own
        so that the frames (up to MAX_MESSAGE_BYTES) are freed when it returns, not kept by a
        loop variable until the next message comes."""
        try:
            frames = router.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return False
        self._handle_input(router, frames, decoders)
        return True

    def _handle_input(self, router: zmq.Socket, frames: list[bytes], decoders: "_Decoders") -> None:
        identity = frames[0]
        self._gone.discard(identity)  # it is (back) on the line
        # [identity, kind, payload]: no front-end message carries arrays, so no extra frames.
        if len(frames) != 3:
            self._garbage(identity, f"{len(frames)} frame(s)")
            return
        kind, payload = frames[1], frames[2:]
        try:
            if kind == EngineCoreRequestType.ADD.value:
                item: Any = decoders.add.decode(payload)
            elif kind == EngineCoreRequestType.ABORT.value:
                item = decoders.abort.decode(payload)
            elif kind == EngineCoreRequestType.UTILITY.value:
                item = decoders.utility.decode(payload)
            else:
                self._garbage(identity, f"unknown request type {kind[:8]!r}")
                return
        except Exception as e:  # whatever a payload makes the decoder raise, this thread lives on
            self._garbage(identity, f"undecodable {kind[:8]!r} payload ({type(e).__name__}: {e})")
            if kind == EngineCoreRequestType.ADD.value:
                self._reject_malformed_add(router, identity, payload, str(e), decoders.encoder)
            return
        self.input_queue.put((kind, identity, item))

    def _reject_malformed_add(self, router: zmq.Socket, identity: bytes, payload: Sequence[bytes],
                              problem: str, encoder: MsgpackEncoder) -> None:
        """An ADD whose request id is still readable gets an ERROR output, so that its sender
        does not wait forever for a request the core never queued."""
        request_id = _leading_request_id(payload[0])
        if request_id is None:
            return  # not even that: nobody to answer
        out = EngineCoreOutput(request_id, finish_reason=FinishReason.ERROR,
                               error=f"malformed request: {problem}")
        try:  # this thread owns the ROUTER: answer directly, outside the busy loop's pipeline
            router.send_multipart([identity, *encoder.encode(EngineCoreOutputs(outputs=[out]))])
        except zmq.ZMQError:
            pass  # it is gone already

    def _garbage(self, identity: bytes, what: str) -> None:
        self._num_garbage += 1
        n = self._num_garbage
        if n <= 10 or n % 1000 == 0:
            logger.warning("dropped a malformed message from front-end %s: %s (%d so far)",
                           identity.hex()[:16], what, n)


class _Decoders:
    """Typed decoders, one per request type (no pickle: only these schemas are accepted), and
    the IO thread's own encoder for its direct replies."""

    def __init__(self) -> None:
        self.encoder = MsgpackEncoder()
        self.add = MsgpackDecoder(EngineCoreRequest)
        self.abort = MsgpackDecoder(list[str])
        self.utility = MsgpackDecoder(UtilityRequest)
