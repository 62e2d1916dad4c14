"""The server's event loop gives way to a CPU engine (TIDAL_SERVER_NICE).

When `tidal serve`'s engine computes on this host's CPUs, the front-end's per-step bursts
(a chunk per stream per step: detokenize, encode, one socket write each) compete with the
engine's compute threads for the same cores. At equal priority a burst preempts a thread in
the middle of a parallel region, and the whole region waits for it. Much nicer than the engine
(`TIDAL_SERVER_NICE`, default +15) the loop runs mostly where the engine leaves a core idle
(its scheduling, sampling, the pauses between kernels); a stream whose next output came
before the loop got to the last one has the two merged in its collector (DELTA: nothing is
lost) and sends one larger chunk. Measured on 2 cores (scripts/bench_serving_ab.py, the
default workload, both servers in one run): +16% output tok/s at nice 15 or 19 against 0, with
a stream's tokens in 0.65-0.8 chunks each and time per output token down by 15-20%; nice 10
changed nothing; at 16 req/s (near saturation) the time to first token rose ~15 ms.

Linux keeps a nice value per thread: only the loop's thread is lowered, and the threads it
starts inherit that (they do its work: tokenizing, chat templates). A process would inherit it
too, and nobody may take a nice value back without privileges, so engine-core processes
(also a replacement after a crash) are started by `popen`: from a thread kept at the
priority the process had before.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

logger = logging.getLogger(__name__)

MAX_NICE = 19  # the lowest priority on the nice scale
_SPAWN_TIMEOUT_S = 60.0  # a fork + exec: far less, unless the machine is stuck
_lock = threading.Lock()
_spawner: ThreadPoolExecutor | None = None  # a thread at the base priority (set by lower_thread_priority)


def thread_nice() -> int:
    """The calling thread's nice value (Linux: per thread)."""
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def lower_thread_priority(increment: int) -> int | None:
    """Raise the calling thread's nice value by `increment` (at most to MAX_NICE); returns
    the new value, or None where nice values are not per thread (only Linux has them so) or
    increment is 0. From here on `popen` starts processes at the priority from before."""
    if increment < 0:
        raise ValueError(f"a priority can only be lowered here (increment >= 0), got {increment}")
    if increment == 0 or not sys.platform.startswith("linux"):
        return None
    global _spawner
    with _lock:
        if _spawner is None:
            spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-spawner")
            spawner.submit(lambda: None).result(timeout=10.0)  # its thread exists now, at this priority
            _spawner = spawner
    target = min(MAX_NICE, thread_nice() + increment)
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), target)
    return target


def popen(cmd: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(cmd, **kwargs)`, started at the process's priority from before
    `lower_thread_priority` (the child inherits the nice value of the thread that starts it)."""
    spawner = _spawner
    if spawner is None:
        return subprocess.Popen(cmd, **kwargs)
    return spawner.submit(subprocess.Popen, cmd, **kwargs).result(timeout=_SPAWN_TIMEOUT_S)
