"""Graceful drain of a headless engine core (issue 12, Build 6).

SIGTERM to `tidal core` does not stop the core at once: it stops accepting (every new request
is refused with "engine core is shutting down", an OVERLOADED rejection: EngineOverloadedError
in the front-end, 503 with Retry-After from a server), lets the requests in flight finish for
up to `timeout_s`, and only then leaves the busy loop; the core process then tells every
front-end (engine_dead with the reason), stops its workers and exits 0. A second SIGTERM, or
SIGINT, stops it at once as before.

A core spawned by a front-end does not drain: its front-end SIGTERMs it on purpose, when it
shuts down itself, and nobody would read the outputs.

The signal handler only calls `request()` (it runs in the main thread between bytecodes, so
a flag is enough); the busy loop calls `should_stop()` once per iteration, and notices within
one step, or within the idle poll when there is no work.
"""
from __future__ import annotations

import logging
from typing import Protocol

from tidal.utils.deadline import Deadline

logger = logging.getLogger("tidal.core.core_proc")

SHUTTING_DOWN = "engine core is shutting down"
DEFAULT_DRAIN_TIMEOUT_S = 30.0


class _Engine(Protocol):
    def stop_accepting(self, reason: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def num_unfinished_requests(self) -> int: ...


class Drain:
    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"the drain timeout must be >= 0 s, got {timeout_s}")
        self.timeout_s = timeout_s
        self.requested = False
        self._deadline: Deadline | None = None
        self._num_in_flight = 0
        self.reason = ""  # once should_stop() said True: what happened, for engine_dead

    def request(self) -> None:
        self.requested = True

    def should_stop(self, engine: _Engine) -> bool:
        """True once a requested drain is done: nothing unfinished, or the timeout passed."""
        if not self.requested:
            return False
        if self._deadline is None:  # the first look after SIGTERM: close the door
            engine.stop_accepting(SHUTTING_DOWN)
            self._deadline = Deadline(self.timeout_s)
            self._num_in_flight = engine.num_unfinished_requests()
            logger.info("SIGTERM: draining; no new requests, waiting up to %gs for %d in flight",
                        self.timeout_s, self._num_in_flight)
        if not engine.has_unfinished_requests():
            self.reason = (f"engine core shut down (SIGTERM; drained: the {self._num_in_flight} "
                           "request(s) in flight finished)")
            logger.info("drained; shutting down")
            return True
        if self._deadline.expired():
            left = engine.num_unfinished_requests()
            self.reason = (f"engine core shut down (SIGTERM; drain timeout of {self.timeout_s:g}s "
                           f"passed with {left} request(s) unfinished)")
            logger.warning("drain timeout (%gs) passed with %d request(s) unfinished; shutting down",
                           self.timeout_s, left)
            return True
        return False
