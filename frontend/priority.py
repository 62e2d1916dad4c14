"""The server's event loop gives way to a CPU engine (TIDAL_SERVER_NICE).

When `tidal serve`'s engine computes on this host's CPUs, the front-end's per-step bursts
(a chunk per stream per step: detokenize, encode, one socket write each) compete with the
engine's compute threads for the same cores. At equal priority a burst preempts a thread in
the middle of a parallel region, and the whole region waits for it. Much nicer than the engine
(`TIDAL_SERVER_NICE`, default +15) the loop runs mostly where the engine leaves a core idle
(its scheduling, sampling, the pauses between kernels); a stream whose next output came
before the loop got to the last one has the two merged in its collector (DELTA: nothing is
lost) and sends one larger chunk. Measured on 2 cores (scripts/bench_serving_ab.py, the
default workload, both servers in one run): +7% to +16% output tok/s at nice 15 or 19 against
0 (the median of each run), with a stream's tokens in 0.65-0.86 chunks each and time per
output token down by 10-20%; nice 10 changed nothing, 12 was 5% slower than 15; at 16 req/s
(near saturation) the time to first token rose ~15 ms. The idle moments come from tidal's
short OpenMP spin (GOMP_SPINCOUNT, tidal_pkg/utils/openmp.py): threads that spin longer leave none,
so a user's own OpenMP wait setting turns the default off.

Linux keeps a nice value per thread: only the loop's thread is lowered, and the threads it
starts inherit that (they do its work: tokenizing, chat templates). A process would inherit it
too, and nobody may take a nice value back without privileges, so engine-core processes
(also a replacement after a crash) are started by `popen`: from a thread kept at the
priority the process had before.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
from typing import Any

from tidal.utils.process import SpawnerThread, stop_process

MAX_NICE = 19  # the lowest priority on the nice scale
_SPAWN_TIMEOUT_S = 60.0  # a fork + exec: far less, unless the machine is stuck
_lock = threading.Lock()
_spawner: SpawnerThread | None = None  # a thread at the base priority (set by lower_thread_priority)


def thread_nice() -> int:
    """The calling thread's nice value (Linux: per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def lower_thread_priority(increment: int) -> int | None:
    """Raise the calling thread's nice value by `increment` (at most to MAX_NICE); returns
    the new value, or None when nothing changed (increment 0, already at MAX_NICE) or nice
    values are not per thread (only Linux has them so). From then on `popen` starts
    processes at the priority from before."""
    if increment < 0:
        raise ValueError(f"a priority can only be lowered here (increment >= 0), got {increment}")
    if not sys.platform.startswith("linux"):
        return None
    current = thread_nice()
    target = min(MAX_NICE, current + increment)
    if target == current:
        return None
    global _spawner
    with _lock:
        if _spawner is None:
            # Its thread starts now, so it keeps this priority (a thread takes its creator's).
            _spawner = SpawnerThread("tidal-core-spawner")
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)
    return target


def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd, **kwargs)`, started at the process's priority from before
    `lower_thread_priority` (a child inherits the nice value of the thread that starts it).
    TimeoutError if the start takes over _SPAWN_TIMEOUT_S; a child that comes up after that
    is stopped and reaped."""
    spawner = _spawner
    if spawner is None:
        return subprocess.Popen(cmd, **kwargs)
    return spawner.call(functools.partial(subprocess.Popen, cmd, **kwargs), _SPAWN_TIMEOUT_S,
                        on_late=stop_process)
