"""Small helpers every layer uses, each written once (torch-free)."""
from __future__ import annotations

import logging
import os
import socket
import time
import traceback

from tidal.protocol import envs

# Temperatures below this sample greedily (argmax); SamplingParams and the sampler agree on it.
GREEDY_EPS = 1e-5


# OpenMP's default wait policy spins idle threads for a while before they sleep. A tidal core
# or worker shares its cores with a front-end, a server, other ranks or other programs: spinning
# threads then take the CPU from the very thread the team waits for, and a step gets several
# times slower (the offline benchmark ran 4x slower beside a busy test run, 24-26 s against
# 6-7 s passive). Passive threads sleep at once. Set in the environment of the processes tidal
# owns before torch loads its OpenMP runtime; an explicit OMP_WAIT_POLICY wins.
_COMPUTE_PROCESS_ENV = {"OMP_WAIT_POLICY": "PASSIVE"}


def compute_process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a tidal core or worker process: os.environ over tidal's defaults
    (_COMPUTE_PROCESS_ENV, then `extra`), so a user's own settings win."""
    return {**_COMPUTE_PROCESS_ENV, **(extra or {}), **os.environ}


def prefer_compute_process_env() -> None:
    """This process is a tidal core about to load torch: take compute_process_env's defaults."""
    for key, value in _COMPUTE_PROCESS_ENV.items():
        os.environ.setdefault(key, value)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def max_useful_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that every sequence at full length can use at once (+1: a block may be held by
    the prefix cache while a sequence fills its last one); more is memory for nothing."""
    return max_num_seqs * cdiv(max_model_len, block_size) + 1


def threads_per_rank(world_size: int) -> int:
    """CPU ranks share the cores: oversubscribed OpenMP threads spin against each other (a
    matmul can get 10x slower), so each of `world_size` ranks takes an equal share."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, world_size))


def format_frames(frames: list[traceback.FrameSummary]) -> str:
    """Innermost frame first: "file.py:12 fn <- caller.py:34 caller"."""
    return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(frames))


def summarize_exception(e: BaseException, frames: int = 3) -> str:
    """The exception and where it happened (its last frames), short enough for one log line."""
    where = format_frames(traceback.extract_tb(e.__traceback__)[-frames:])
    return f"{type(e).__name__}: {e} (at {where})" if where else f"{type(e).__name__}: {e}"


class Deadline:
    """A point in time.monotonic(); every bounded wait loop polls in slices against one."""

    __slots__ = ("at",)

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self, cap_ms: int) -> int:
        """The next poll slice: at most `cap_ms`, never past the deadline."""
        return max(0, min(cap_ms, int(self.remaining_s() * 1000)))

    def expired(self) -> bool:
        return time.monotonic() >= self.at


def setup_logging(process_label: str) -> None:
    """Root logging for a tidal process at TIDAL_LOG_LEVEL, each line naming the process."""
    logging.basicConfig(
        level=envs.TIDAL_LOG_LEVEL.upper(),
        format=f"%(asctime)s %(levelname)s [{process_label} %(process)d] %(name)s: %(message)s")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (racy: prefer `process.listen_socket`, which keeps it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
