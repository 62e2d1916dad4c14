"""Start-up phases of a worker process, logged as one line (TIDAL_LOG_STARTUP=1: at WARNING, so
it shows at the default log level; scripts/bench_startup.py reads it).

The line carries wall-clock stamps (process start, ready) besides the phase durations, so a
front-end can place the core's phases on its own timeline.
"""
from __future__ import annotations

import logging
import os
import time

from tidal.protocol import envs

logger = logging.getLogger(__name__)


def process_start_epoch() -> float | None:
    """When this process started (wall clock, ~10 ms resolution), from /proc; None elsewhere."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of the man page; two fields precede ")"
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return None


class StartupTimer:
    """Phase durations since the previous mark; the first phase starts at process start."""

    def __init__(self, first_phase: str) -> None:
        self.process_start = process_start_epoch()
        now = time.time()
        self.phases: list[tuple[str, float]] = []
        if self.process_start is not None:
            self.phases.append((first_phase, now - self.process_start))
        self._last = now

    def mark(self, phase: str) -> None:
        now = time.time()
        self.phases.append((phase, now - self._last))
        self._last = now

    def log(self, rank: int) -> None:
        parts = ", ".join(f"{name} {seconds:.3f} s" for name, seconds in self.phases)
        level = logging.WARNING if envs.TIDAL_LOG_STARTUP else logging.INFO
        logger.log(level, "tidal start-up rank %d: %s (process start %.3f, ready %.3f)", rank, parts,
                   self.process_start or 0.0, self._last)
