"""ZeroMQ CURVE security for a headless engine core's TCP socket (`tidal core --key-file`).

CURVE (libzmq + libsodium, not a home-made scheme) encrypts the connection and authenticates
both ends. On its own a CURVE server accepts any client that knows the server's *public* key,
so the core also runs a ZAP handler (pyzmq's ThreadAuthenticator) that admits only the client
key of its key file: a front-end must hold that client *secret* key to get through.

Key file (JSON, written 0600 by `tidal core-keygen FILE`; keys in Z85, 40 characters each):

    {"format": "tidal-core-key/1",
     "server_public_key": "...", "server_secret_key": "...",
     "client_public_key": "...", "client_secret_key": "..."}

The core needs all four. A front-end (`core_key_file=FILE`) reads the server public key and
the client keypair; it may hold a copy without "server_secret_key". A front-end without the
file, or with another one, fails the handshake: the core never sees its messages (its HELLO
goes unanswered until engine_start_timeout_s). The core refuses to bind a TCP address that is
not loopback without a key file, and a key file that others may read.
"""
from __future__ import annotations

import hmac
import ipaddress
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

if TYPE_CHECKING:
    from tidal.protocol.config import EngineConfig
    from zmq.auth.thread import ThreadAuthenticator

KEY_FILE_FORMAT = "tidal-core-key/1"
_FIELDS = ("server_public_key", "server_secret_key", "client_public_key", "client_secret_key")
_Z85_KEY_LEN = 40


@dataclass(frozen=True, repr=False)  # repr=False: never print a secret key in a log
class CoreKey:
    server_public_key: bytes
    server_secret_key: bytes | None  # None in a front-end's copy
    client_public_key: bytes
    client_secret_key: bytes


@dataclass(frozen=True, repr=False)
class Curve:
    """CURVE options for one socket; make_socket applies them before bind/connect (libzmq reads
    the mechanism when a connection is made). `server_key` None: this socket is the server."""

    public_key: bytes
    secret_key: bytes
    server_key: bytes | None = None

    def apply(self, sock: zmq.Socket) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE security (libsodium)")
        if self.server_key is None:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
        else:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)


# Why a front-end's DEALER has no connection to send on right after connect(): libzmq drops a
# connection whose handshake the peer refused (a keyed core and no key or another client key,
# or a keyless core and a key) and, unlike a lost connection, never retries it; a blocking
# send would then wait for good.
HANDSHAKE_REFUSED = ("refused the connection handshake: a keyed core serves only front-ends "
                     "holding its key file (core_key_file), and a keyless one only front-ends without")


def generate_key_file(path: str) -> None:
    """Write a new key file, readable by its owner only; never overwrites one."""
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    doc = {"format": KEY_FILE_FORMAT}
    for name, key in zip(_FIELDS, (server_public, server_secret, client_public, client_secret)):
        doc[name] = key.decode("ascii")
    # O_EXCL: an existing file (maybe a key in use) is an error, not silently replaced; the
    # mode is set at creation, so the secret is never readable by others, not even briefly.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def load_key_file(path: str, *, server: bool) -> CoreKey:
    """The keys in `path` (ValueError naming what is wrong). `server`: the core's side, which
    needs the server secret key."""
    try:
        st = os.stat(path)
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read core key file {path!r}: {e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"core key file {path!r} is not JSON ({e}); make one with `tidal core-keygen FILE`") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"core key file {path!r} is accessible by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); run `chmod 600 {path}`")
    if not isinstance(doc, dict) or doc.get("format") != KEY_FILE_FORMAT:
        raise ValueError(f"core key file {path!r} is not a {KEY_FILE_FORMAT} file; make one with "
                         "`tidal core-keygen FILE`")
    keys: dict[str, bytes | None] = {}
    for name in _FIELDS:
        value = doc.get(name)
        if value is None and name == "server_secret_key" and not server:
            keys[name] = None
            continue
        if not isinstance(value, str) or len(value) != _Z85_KEY_LEN:
            raise ValueError(f"core key file {path!r}: {name} must be a {_Z85_KEY_LEN}-character Z85 key")
        try:
            z85.decode(value)
        except Exception:
            raise ValueError(f"core key file {path!r}: {name} is not valid Z85") from None
        keys[name] = value.encode("ascii")
    return CoreKey(**keys)  # type: ignore[arg-type]


# How long a vague handshake failure waits for a reconnect's specific one (libzmq reconnects
# every 100 ms by default, so a few attempts fit).
VAGUE_GRACE_S = 1.0
HANDSHAKE_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class HandshakeWatch:
    """The ZMTP handshake events of a front-end's DEALER to a headless core, read while it waits
    for the core's answer to HELLO. A core that refuses the front-end's key never answers
    anything, so without these the front-end could only time out; with them it says at once
    which key is wrong. Attach before connect (events before the monitor are lost); `close`
    before another monitor (the core watcher's) is put on the socket."""

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, keyed: bool) -> None:
        self._keyed = keyed
        # The first vague failure's words and when it came (see problem()).
        self._vague: tuple[str, float] | None = None
        addr = f"inproc://tidal-handshake-{id(self):x}"
        sock.monitor(addr, HANDSHAKE_EVENTS)
        # A plain socket on the same libzmq context (the owner's may be a zmq.asyncio one).
        self._mon: zmq.Socket = zmq.Context.shadow(ctx.underlying).socket(zmq.PAIR)
        self._mon.setsockopt(zmq.LINGER, 0)
        self._mon.connect(addr)

    def problem(self, wait_s: float = 0.0) -> str | None:
        """Why the core refused this front-end (words naming the key to fix), or None so far
        (reading events for up to `wait_s`). A vague failure -- the core hung up mid-handshake,
        which is what a keyed core often does to a keyless front-end before its mechanism
        mismatch reaches it -- is given VAGUE_GRACE_S (or the rest of `wait_s`) for the
        reconnect's specific event to name the key instead."""
        from zmq.utils.monitor import recv_monitor_message

        deadline = time.monotonic() + wait_s
        while self._mon.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            msg = recv_monitor_message(self._mon)
            event, value = msg["event"], int(msg["value"])
            if (found := self._named(event, value)) is not None:
                return found
            if self._vague is None and (vague := self._vague_words(event, value)) is not None:
                self._vague = (vague, time.monotonic())
        if self._vague is not None and (wait_s > 0 or time.monotonic() - self._vague[1] >= VAGUE_GRACE_S):
            return self._vague[0]
        return None

    def _named(self, event: int, value: int) -> str | None:
        """The words for an event that tells which key is wrong, else None."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return ("refused this front-end's CURVE key: core_key_file must be a copy of the key file the "
                    "core runs with (`tidal core --key-file FILE`)")
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL and self._keyed:
            return ("failed the CURVE handshake: the server key in core_key_file is not this core's key "
                    "(core_key_file must be a copy of the key file the core runs with)")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            return ("is not keyed, and this front-end offered a CURVE key (core_key_file): drop "
                    "core_key_file, or start the core with --key-file FILE" if self._keyed else
                    "is keyed (CURVE) and this front-end has no key: pass core_key_file=FILE, a copy of "
                    "the core's key file")
        return None

    def _vague_words(self, event: int, value: int) -> str | None:
        """The words for a failure that does not say why (None: not a failure)."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # a keyless front-end (see _named)
            return (f"hung up during the ZMTP handshake (errno {value}): a keyed (CURVE) core does this to a "
                    "front-end without its key (pass core_key_file=FILE, a copy of the core's key file); "
                    "or is this not a tidal engine core?")
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            return f"failed the ZMTP handshake (protocol error {value:#x}): is this a tidal engine core?"
        return None

    def close(self, sock: zmq.Socket) -> None:
        """Stop the monitor, then close its reader: libzmq's IO thread sends monitor events
        with a blocking send, so a reader closed first could hang every socket of the context."""
        try:
            sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._mon.close(linger=0)


def server_curve(key: CoreKey) -> Curve:
    assert key.server_secret_key is not None
    return Curve(key.server_public_key, key.server_secret_key)


def client_curve_options(config: EngineConfig) -> Curve | None:
    """The front-end DEALER's CURVE options: a headless core (core_address) with a key file.
    A spawned core listens on a private ipc path and uses no key."""
    if config.core_address is None or config.core_key_file is None:
        return None
    key = load_key_file(config.core_key_file, server=False)
    return Curve(key.client_public_key, key.client_secret_key, server_key=key.server_public_key)


class _AllowClientKey:
    """ZAP credentials provider: admits exactly the key file's client public key."""

    def __init__(self, client_public_key: bytes) -> None:
        self._key = client_public_key

    def callback(self, domain: str, key: bytes) -> bool:
        return hmac.compare_digest(key, self._key)


def start_authenticator(ctx: zmq.Context, key: CoreKey) -> ThreadAuthenticator:
    """A ZAP handler in `ctx` admitting only `key`'s client; start it before binding."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_AllowClientKey(key.client_public_key))
    return auth


def check_bind_security(address: str, key_file: str | None) -> None:
    """ValueError for a TCP bind off loopback without a key file: the core would serve anyone
    who can reach the address. ipc paths (file permissions) and loopback need no key."""
    if key_file is not None or not address.startswith("tcp://"):
        return
    host = address[len("tcp://"):].rpartition(":")[0]
    if not _is_loopback(host):
        raise ValueError(
            f"refusing to bind {address!r} without a key: a core reachable from other hosts must "
            "be keyed (make a key file with `tidal core-keygen FILE`, then pass --key-file FILE to "
            "the core and core_key_file=FILE to its front-ends), or bind tcp://127.0.0.1:PORT")


def _is_loopback(host: str) -> bool:
    """True only if every address the host resolves to is a loopback one (interface names and
    anything unresolvable count as reachable from outside)."""
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return False
    for info in infos:
        addr = ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
        mapped = addr.ipv4_mapped if isinstance(addr, ipaddress.IPv6Address) else None
        if not (addr.is_loopback or (mapped is not None and mapped.is_loopback)):
            return False
    return bool(infos)
