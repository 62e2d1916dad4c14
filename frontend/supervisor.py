"""One engine core's supervisor: the front-end's one home for crash recovery.

Each engine core has one `CoreSupervisor` (its client's `supervisor`; data parallelism holds
one per rank, each resuming its own requests) in exactly one state:

    LIVE          ── core gone, a restart allowed ──────────────────▶ LOST
    LOST          ── recover() ─────────────────────────────────────▶ RECONNECTING
    RECONNECTING  ── new core answered, open requests resent ───────▶ LIVE
    LIVE          ── core gone, no restart allowed ─────────────────▶ DEAD
    RECONNECTING  ── start failed past the budget, or resume failed ▶ DEAD
    any but DEAD  ── shutdown() / fail() ───────────────────────────▶ DEAD  (terminal)

- LIVE: requests, aborts and utility calls go to the core.
- LOST: the core is gone (watcher thread, or its engine_dead message); sends are dropped (the
  front-end holds every open request and resends it) until the front-end calls `recover()`.
- RECONNECTING: a replacement is starting (a headless core: reached again on its address; a
  spawned one that dies while starting is retried while restarts are left); then the open
  requests are triaged (frontend/recovery.py) and resent, and the core is LIVE again. A
  death reported meanwhile (the new core's watcher) is applied once LIVE.
- DEAD: terminal; `error` (EngineDeadError) is raised by every later call and the dead
  callbacks end every open stream. `shutdown()` ends here too, from any state.
Any other move is a bug and raises IllegalTransition. A restart is allowed only once a
front-end attached (it can resume requests), while fewer than max_core_restarts happened
within CORE_RESTART_WINDOW_S (a headless core: with core_reconnect_timeout_s > 0) and the
application is not shutting down.
"""
from __future__ import annotations

import asyncio
import collections
import enum
import logging
import threading
import time
from typing import Callable, Protocol

from tidal.protocol.config import CORE_RESTART_WINDOW_S, EngineConfig
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutput
from tidal.utils.logging_utils import summarize_exception

logger = logging.getLogger(__name__)


class CoreState(enum.Enum):
    LIVE = "live"
    LOST = "lost"
    RECONNECTING = "reconnecting"
    DEAD = "dead"


_NEXT: dict[CoreState, frozenset[CoreState]] = {
    CoreState.LIVE: frozenset({CoreState.LOST, CoreState.DEAD}),
    CoreState.LOST: frozenset({CoreState.RECONNECTING, CoreState.DEAD}),
    CoreState.RECONNECTING: frozenset({CoreState.LIVE, CoreState.DEAD}),
    CoreState.DEAD: frozenset(),
}

# The front-end's resubmission: given the lost core's failing step (None: unknown), resend the
# open requests to the new core; returns the ERROR outputs of those given up.
ResumeFn = Callable[[list[str] | None], list[EngineCoreOutput]]


class IllegalTransition(RuntimeError):
    """A move the state machine does not have (a caller's bug, never a core's failure)."""


class CoreLink(Protocol):
    """What a supervisor needs of its core's connection (core_connection.MPClientBase)."""

    def before_replace(self) -> None:
        """In the recovering thread, before the replacement: drop what the lost core left."""

    def replace_core(self) -> object:
        """Blocking (maybe in a worker thread): stop the lost core, start or reach a new one,
        handshake. Raises when that fails."""

    def after_replace(self) -> None:
        """In the recovering thread, once the new core answered."""


class CoreSupervisor:
    def __init__(self, config: EngineConfig, link: CoreLink) -> None:
        self.config = config
        self._link = link
        self.state = CoreState.LIVE
        self.reason: str | None = None  # why the core was lost (or died)
        self.error: EngineDeadError | None = None  # set on entering DEAD, never replaced
        self.dead_by_shutdown = False  # DEAD because shutdown() came first (not a failure)
        # From LIVE -> LOST on: this front-end's requests in the step that failed (the lost
        # core's engine_dead said so); None when unknown (e.g. the process just vanished).
        self.failed_step_request_ids: list[str] | None = None
        self.num_restarts = 0
        # Set when the application began to shut down (tidal serve, at its SIGTERM/SIGINT),
        # before it stops the core: a core that goes from then on is part of that shutdown.
        self.shutting_down = False
        self._restart_times: collections.deque[float] = collections.deque()
        self._resume: ResumeFn | None = None  # None until attach(): no restart
        self._on_lost: list[Callable[[str], None]] = []
        self._on_dead: list[Callable[[EngineDeadError], None]] = []
        # A death reported while RECONNECTING (the new core's watcher): applied once LIVE.
        self._gone_meanwhile: tuple[str, list[str] | None] | None = None
        # Transitions come from the watcher thread and the front-end's: one at a time.
        self._lock = threading.Lock()
        self._replacing = threading.Lock()  # held while a replacement starts; shutdown waits

    def attach(self, resume: ResumeFn, *, on_lost: Callable[[str], None] | None = None,
               on_dead: Callable[[EngineDeadError], None] | None = None) -> None:
        """The front-end, once it can resume requests: from now on a lost core is restarted.
        `on_lost(reason)` / `on_dead(error)` run in the thread that noticed (LLM needs neither:
        it recovers in the wait that notices)."""
        self._resume = resume
        if on_lost is not None:
            self._on_lost.append(on_lost)
        if on_dead is not None:
            self._on_dead.append(on_dead)

    def attach_dead_callback(self, on_dead: Callable[[EngineDeadError], None]) -> None:
        """One more `on_dead` (data parallelism: one core's death fails the others)."""
        self._on_dead.append(on_dead)

    @property
    def live(self) -> bool:
        return self.state is CoreState.LIVE

    @property
    def restarting(self) -> bool:
        """The core is lost and a replacement is due or starting (LOST, RECONNECTING)."""
        return self.state is CoreState.LOST or self.state is CoreState.RECONNECTING

    def check(self) -> None:
        """EngineDeadError once DEAD."""
        if self.error is not None:
            raise self.error

    # ------------------------------------------------------------------ transitions
    def _to(self, new: CoreState) -> None:
        """Move (the caller holds _lock)."""
        if new not in _NEXT[self.state]:
            raise IllegalTransition(f"engine core supervisor: {self.state.value} -> {new.value}")
        self.state = new

    def _die(self, error: EngineDeadError) -> list[Callable[[EngineDeadError], None]]:
        """-> DEAD (the caller holds _lock); returns the callbacks to run once it released it."""
        if self.state is CoreState.DEAD:
            return []
        self._to(CoreState.DEAD)
        self.error = error
        return list(self._on_dead)

    def _notify_dead(self, callbacks: list[Callable[[EngineDeadError], None]]) -> None:
        """Outside _lock: a callback may call back in (AsyncLLM fails its streams)."""
        for fn in callbacks:
            assert self.error is not None
            fn(self.error)

    def core_gone(self, reason: str, *, restartable: bool = True,
                  failed_step_request_ids: list[str] | None = None) -> None:
        """The core is gone (from the watcher thread, or the reader on an engine_dead message):
        LIVE -> LOST when a restart is allowed, else (or not `restartable`: a failure of this
        front-end's own) -> DEAD. Idempotent: a second report changes nothing, except that the
        core's own last word (its failing step) still counts after the watcher's report."""
        lost: list[Callable[[str], None]] = []
        dead: list[Callable[[EngineDeadError], None]] = []
        with self._lock:
            if self.state is CoreState.LOST:
                if self.failed_step_request_ids is None:
                    self.failed_step_request_ids = failed_step_request_ids
                return
            if self.state is CoreState.RECONNECTING:
                self._gone_meanwhile = self._gone_meanwhile or (reason, failed_step_request_ids)
                return
            if self.state is CoreState.DEAD:
                return
            if restartable and self._restart_allowed():
                self._to(CoreState.LOST)
                self.reason, self.failed_step_request_ids = reason, failed_step_request_ids
                logger.error("engine core lost: %s; restarting it and resuming its requests "
                             "(restart %d of at most %d within %gs)", reason, len(self._restart_times) + 1,
                             self.config.max_core_restarts, CORE_RESTART_WINDOW_S)
                lost = list(self._on_lost)
            else:
                self.reason = reason
                dead = self._die(EngineDeadError(f"Engine core is dead: {reason}"))
        for fn in lost:
            fn(reason)
        self._notify_dead(dead)

    def fail(self, reason: str) -> EngineDeadError:
        """-> DEAD from any state (a failure no restart mends); returns the error to raise."""
        with self._lock:
            dead = self._die(EngineDeadError(f"Engine core is dead: {reason}"))
        self._notify_dead(dead)
        assert self.error is not None
        return self.error

    def shutdown(self) -> None:
        """-> DEAD from any state ("the engine was shut down"); waits (bounded) for a replacement
        in flight, which sees DEAD within one poll slice and gives up."""
        with self._lock:
            self.dead_by_shutdown = self.state is not CoreState.DEAD
            dead = self._die(EngineDeadError("the engine was shut down"))
        self._notify_dead(dead)
        if not self._replacing.acquire(timeout=10.0):
            logger.warning("a core restart did not stop within 10 s of shutdown")
        else:
            self._replacing.release()

    def _restart_allowed(self) -> bool:
        cfg = self.config
        if self._resume is None or self.shutting_down or cfg.max_core_restarts <= 0:
            return False
        if cfg.core_address is not None and cfg.core_reconnect_timeout_s <= 0:
            return False
        times, now = self._restart_times, time.monotonic()
        while times and now - times[0] > CORE_RESTART_WINDOW_S:
            times.popleft()
        return len(times) < cfg.max_core_restarts

    # ------------------------------------------------------------------ recovery
    def recover(self) -> list[EngineCoreOutput]:
        """LOST -> RECONNECTING -> LIVE, blocking: replace the core and resend the open requests;
        returns the ERROR outputs of those given up, for the caller to process as core outputs.
        EngineDeadError (and DEAD) when that fails."""
        self._begin()
        self._replace()
        return self._resume_requests()

    async def recover_async(self) -> list[EngineCoreOutput]:
        """`recover()` with the blocking replacement in a worker thread (the rest in the loop's)."""
        self._begin()
        await asyncio.to_thread(self._replace)
        return self._resume_requests()

    def _begin(self) -> None:
        with self._lock:
            self.check()  # a shutdown came first
            self._to(CoreState.RECONNECTING)
        self._link.before_replace()

    def _replace(self) -> None:
        with self._replacing:
            while True:
                with self._lock:
                    self.check()  # shut down meanwhile
                    self._restart_times.append(time.monotonic())
                    self.num_restarts += 1
                try:
                    self._link.replace_core()
                    break
                except BaseException as e:
                    why = f"restarting it failed: {summarize_exception(e)}"
                    # A spawned replacement that died while starting (killed, say) counts as one
                    # more restart, while any are left; a headless core had its whole window.
                    if (self.config.core_address is not None or self.error is not None
                            or not isinstance(e, Exception) or not self._restart_allowed()):
                        error = self.fail(f"{self.reason}; {why}")
                        logger.error("%s", error)
                        raise error from None
                    logger.error("engine core lost again while starting (%s); trying once more", why)
        logger.warning("engine core restarted (%d restart(s) so far)", self.num_restarts)

    def _resume_requests(self) -> list[EngineCoreOutput]:
        self._link.after_replace()
        assert self._resume is not None  # no restart without attach()
        try:
            give_up = self._resume(self.failed_step_request_ids)
        except Exception as e:  # unhandled, every stream would wait for good
            logger.exception("resuming the requests on the restarted engine core failed")
            raise self.fail(f"resuming the requests on the restarted engine core failed: "
                            f"{type(e).__name__}: {e}") from None
        with self._lock:
            self.check()  # shut down while resending
            self._to(CoreState.LIVE)
            gone, self._gone_meanwhile = self._gone_meanwhile, None
        if gone is not None:  # the new core went while its requests were resent
            self.core_gone(gone[0], failed_step_request_ids=gone[1])
        return give_up
