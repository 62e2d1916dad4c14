"""OpenMP threads of tidal's compute processes (engine core, workers): the wait policy they are
started with and each CPU rank's share of the cores."""
from __future__ import annotations

import os


# OpenMP's default (libgomp) spins an idle thread ~300,000 times (milliseconds) before it
# sleeps. A tidal core or worker shares its cores with a front-end, a server, other ranks or
# other programs: the spinning threads then take the CPU from the very thread the team waits
# for, and steps get several times slower (offline benchmark beside one CPU hog: 12.8 s; with a
# 3,000 spin 6-7.5 s; passive, sleeping at once, 7.0 s). Sleeping at once costs when the machine
# is quiet (passive 14-18% slower in-process), since a forward's ops come microseconds apart; a
# 3,000-spin (~80 us here: libgomp pauses once per count, ~26 ns on this EPYC) bridges those gaps
# and sleeps through the longer ones (scheduling, sampling, a preempted team mate). 30,000
# (~0.8 ms) measured 0.92-1.23x offline in alternating rounds (median 1.09x) and no better
# serving: not worth the CPU it takes from a front-end. Set in the environment of the processes
# tidal owns before torch loads libgomp; the user's own OMP_WAIT_POLICY / GOMP_SPINCOUNT win.
_COMPUTE_PROCESS_ENV = {"GOMP_SPINCOUNT": "3000"}


def _compute_process_defaults() -> dict[str, str]:
    """_COMPUTE_PROCESS_ENV, unless the user chose an OpenMP wait behaviour (GOMP_SPINCOUNT
    would override their OMP_WAIT_POLICY)."""
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return {}
    return dict(_COMPUTE_PROCESS_ENV)


def omp_wait_is_tidals() -> bool:
    """Whether tidal's processes get tidal's OpenMP wait behaviour (the user set neither
    OMP_WAIT_POLICY nor GOMP_SPINCOUNT)."""
    return bool(_compute_process_defaults())


def compute_process_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a tidal core or worker process: os.environ over tidal's defaults
    (_compute_process_defaults, then `extra`), so a user's own settings win."""
    return {**_compute_process_defaults(), **(extra or {}), **os.environ}


def prefer_compute_process_env() -> None:
    """This process is a tidal core about to load torch: take compute_process_env's defaults."""
    os.environ.update(_compute_process_defaults())


def threads_per_rank(world_size: int) -> int:
    """CPU ranks share the cores: oversubscribed OpenMP threads spin against each other (a
    matmul can get 10x slower), so each of `world_size` ranks takes an equal share."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, world_size))


def take_data_parallel_share(rank: int, size: int) -> list[int] | None:
    """Data-parallel engine cores on one host's CPUs: core `rank` of `size` keeps only its
    contiguous share of this process's CPUs (its workers, started later, inherit it), so the
    cores' OpenMP teams never spin against each other and threads_per_rank counts the share.
    Returns the CPUs kept; None (nothing changed) when there are fewer CPUs than cores (they
    share then) or the platform cannot pin."""
    if size <= 1 or not hasattr(os, "sched_setaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < size:
        return None
    per = len(cpus) // size
    share = cpus[rank * per:(rank + 1) * per]
    os.sched_setaffinity(0, share)
    return share
