"""Small helpers every layer uses, each written once (torch-free)."""
from __future__ import annotations

import json
import logging
import logging.config
import os
import socket
import time
import traceback
from typing import Any

from tidal.protocol import envs

# Temperatures below this sample greedily (argmax); SamplingParams and the sampler agree on it.
GREEDY_EPS = 1e-5


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


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def max_useful_kv_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that every sequence at full length can use at once (+1: a block may be held by
    the prefix cache while a sequence fills its last one); more is memory for nothing."""
    return max_num_seqs * cdiv(max_model_len, block_size) + 1


def max_step_tokens(max_num_batched_tokens: int, max_model_len: int, enable_chunked_prefill: bool) -> int:
    """The most tokens one step can schedule: without chunked prefill a whole max_model_len
    prompt must fit one step (as vLLM). The scheduler's budget and the runner's buffers."""
    return max_num_batched_tokens if enable_chunked_prefill else max(max_num_batched_tokens, max_model_len)


def _gib(n: float) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def kv_cache_budget_from_memory(total_bytes: int, used_bytes: int, peak_activation_bytes: int,
                                utilization: float) -> int:
    """KV cache bytes under vLLM's `gpu_memory_utilization`: this engine may hold `utilization`
    of the device's memory in all; what is in use already (weights, CUDA context, other
    processes) and the activation peak of the largest step come off it. May be negative."""
    return int(total_bytes * utilization) - used_bytes - peak_activation_bytes


def kv_blocks_for_budget(budget_bytes: int, bytes_per_block: int, *, max_num_seqs: int, max_model_len: int,
                         block_size: int, how: str) -> int:
    """Blocks of `bytes_per_block` the budget holds, capped at what max_num_seqs sequences of
    max_model_len can use. A budget that cannot hold one max_model_len sequence is a ValueError
    with the numbers (`how` says where the budget came from, to name the knob to turn)."""
    per_seq = cdiv(max_model_len, block_size)
    blocks = max(0, budget_bytes) // bytes_per_block
    if blocks < per_seq:
        raise ValueError(
            f"the KV cache budget ({how}) is {_gib(max(0, budget_bytes))}, {blocks} blocks of "
            f"{bytes_per_block} bytes; one sequence of max_model_len={max_model_len} needs {per_seq} "
            f"blocks ({_gib(per_seq * bytes_per_block)}): raise it or lower max_model_len")
    return min(blocks, max_useful_kv_blocks(max_num_seqs, max_model_len, block_size))


def cuda_graph_capture_sizes(cap: int) -> list[int]:
    """vLLM's CUDA graph batch sizes up to `cap`, ascending: 1, 2, 4, then steps of 8 up to
    256, then of 16; `cap` itself included, so every batch up to it has a graph to replay."""
    if cap < 1:
        return []
    grid = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, cap + 1, 16))
    return [s for s in grid if s < cap] + [cap]


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
    """Root logging for a tidal process at TIDAL_LOG_LEVEL, each line naming the process; or
    the logging config in TIDAL_LOGGING_CONFIG_PATH when that is set."""
    if envs.TIDAL_LOGGING_CONFIG_PATH is not None:
        apply_logging_config(load_logging_config(envs.TIDAL_LOGGING_CONFIG_PATH))
        return
    logging.basicConfig(
        level=envs.TIDAL_LOG_LEVEL.upper(),
        format=f"%(asctime)s %(levelname)s [{process_label} %(process)d] %(name)s: %(message)s")


def load_logging_config(path: str) -> dict[str, Any]:
    """A JSON logging.config dict from `path`; ValueError naming the file when it is not one."""
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"logging config {path!r}: {type(e).__name__}: {e}") from None
    if not isinstance(config, dict):
        raise ValueError(f"logging config {path!r}: expected a JSON object (a logging.config dict)")
    return config


def apply_logging_config(config: dict[str, Any]) -> None:
    """dictConfig, keeping loggers the config does not name (dictConfig's own default would
    silence every logger created before it: the engine's, uvicorn's)."""
    logging.config.dictConfig({"disable_existing_loggers": False, **config})


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (racy: prefer `process.listen_socket`, which keeps it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
