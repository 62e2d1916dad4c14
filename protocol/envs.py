"""Every environment variable tidal reads, in one place (as vLLM's envs.py).

Read lazily: `envs.TIDAL_CPU_KERNELS` looks at os.environ on each access, so a variable set
after import (a test's monkeypatch, a parent setting a child's environment) takes effect.
Each is documented in the README's table.
"""
from __future__ import annotations

import os
from typing import Any, Callable


def _flag(name: str, default: bool) -> Callable[[], bool]:
    def read() -> bool:
        value = os.environ.get(name)
        if value is None or not value.strip():
            return default
        return value.strip().lower() not in ("0", "false", "no", "off")
    return read


def _int_in(name: str, default: int, low: int, high: int | None = None) -> Callable[[], int]:
    """An integer in [low, high] (no upper bound: None); ValueError naming the range otherwise."""
    def read() -> int:
        raw = os.environ.get(name)
        if raw is None or not raw.strip():
            return default
        try:
            value = int(raw)
        except ValueError:
            value = low - 1
        if value < low or (high is not None and value > high):
            allowed = (f"an integer in [{low}, {high}]" if high is not None
                       else "a positive integer" if low == 1 else f"an integer >= {low}")
            raise ValueError(f"{name} must be {allowed}, got {raw!r}.")
        return value
    return read


def _positive_int(name: str, default: int) -> Callable[[], int]:
    return _int_in(name, default, 1)


def _cache_dir() -> str:
    return os.environ.get("TIDAL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tidal")


_VARIABLES: dict[str, Callable[[], Any]] = {
    # Logging level of every tidal process (DEBUG shows tracebacks the CLI shortens).
    "TIDAL_LOG_LEVEL": lambda: os.environ.get("TIDAL_LOG_LEVEL", "WARNING"),
    # A JSON logging.config dict file every tidal process applies instead (vLLM's
    # VLLM_LOGGING_CONFIG_PATH; `tidal serve --log-config-file` sets it for its engine processes).
    "TIDAL_LOGGING_CONFIG_PATH": lambda: os.environ.get("TIDAL_LOGGING_CONFIG_PATH") or None,
    # 0: LLM runs the engine core in the calling process (easier to debug).
    "TIDAL_ENABLE_MULTIPROCESSING": _flag("TIDAL_ENABLE_MULTIPROCESSING", True),
    # Made models, tokenizers and compiled kernels (default ~/.cache/tidal).
    "TIDAL_CACHE_DIR": _cache_dir,
    # 0: no C kernels on CPU, torch ops only.
    "TIDAL_CPU_KERNELS": _flag("TIDAL_CPU_KERNELS", True),
    # float32 linear layers on CPU: auto (tidal's panel GEMM where vectorized, else oneDNN) |
    # onednn (oneDNN packed weights) | torch (F.linear). worker/layers/gemm.py.
    "TIDAL_CPU_GEMM": lambda: os.environ.get("TIDAL_CPU_GEMM", "auto"),
    # 0: the CPU GEMM/GEMV kernels split their work over OpenMP regions instead of tidal's team,
    # whose caller never waits for a thread that has not started (worker/csrc/thread_pool.h).
    "TIDAL_CPU_THREAD_POOL": _flag("TIDAL_CPU_THREAD_POOL", True),
    # 0: fp16/bf16 models on CPU compute in torch's half ops instead of half weights + float32 compute.
    "TIDAL_CPU_HALF_WEIGHTS": _flag("TIDAL_CPU_HALF_WEIGHTS", True),
    # 1: the front-end loads transformers' tokenizer even where tokenizers' own would do (frontend/tokenizer.py).
    "TIDAL_FULL_TOKENIZER": _flag("TIDAL_FULL_TOKENIZER", False),
    # 0: oneDNN GEMMs run on the exact row count instead of padding it to a bucket (worker/layers/gemm.py).
    "TIDAL_CPU_GEMM_BUCKETS": _flag("TIDAL_CPU_GEMM_BUCKETS", True),
    # 1: each worker logs its start-up phases at WARNING (worker/startup_timer.py; scripts/bench_startup.py).
    "TIDAL_LOG_STARTUP": _flag("TIDAL_LOG_STARTUP", False),
    # auto (by device: cpu kernels on CPU, triton on CUDA) | torch (the reference, any device) | cpu | triton.
    "TIDAL_ATTENTION_BACKEND": lambda: os.environ.get("TIDAL_ATTENTION_BACKEND", "auto"),
    # The key `tidal serve` requires as `Authorization: Bearer KEY` (--api-key wins; vLLM's VLLM_API_KEY).
    "TIDAL_API_KEY": lambda: os.environ.get("TIDAL_API_KEY") or None,
    # vLLM's name for the same key: a deployment keyed the vLLM way is keyed here too (it wins).
    "VLLM_API_KEY": lambda: os.environ.get("VLLM_API_KEY") or None,
    # How much nicer than its engine `tidal serve`'s event loop runs when it started that engine
    # and it computes on this host's CPUs (frontend/priority.py); 0: the same priority.
    "TIDAL_SERVER_NICE": _int_in("TIDAL_SERVER_NICE", 15, 0, 19),
    # Request limits (vLLM's VLLM_MAX_N_SEQUENCES and friends, same defaults): n per request (and
    # prompts x n in a server request), prompts per /v1/completions request, stop strings and
    # bad_words per server request. A request over one is refused (400) before any work.
    "TIDAL_MAX_N_SEQUENCES": _positive_int("TIDAL_MAX_N_SEQUENCES", 16384),
    "TIDAL_MAX_COMPLETION_PROMPTS": _positive_int("TIDAL_MAX_COMPLETION_PROMPTS", 1024),
    "TIDAL_MAX_STOP_STRINGS": _positive_int("TIDAL_MAX_STOP_STRINGS", 4),
    "TIDAL_MAX_NUM_BAD_WORDS": _positive_int("TIDAL_MAX_NUM_BAD_WORDS", 128),
    # 0: speculative decoding never pauses for its cost (core/spec_cost.py): every step that may
    # propose does. For tests that count accepted proposals on a model too small for them to pay.
    "TIDAL_SPEC_COST_RULE": _flag("TIDAL_SPEC_COST_RULE", True),
    # The C compiler for the CPU kernels (None: cc or gcc on PATH).
    "CC": lambda: os.environ.get("CC") or None,
}

__all__ = sorted(_VARIABLES)


def __getattr__(name: str) -> Any:
    read = _VARIABLES.get(name)
    if read is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return read()


def is_set(name: str) -> bool:
    """Whether the user gave tidal's variable `name` a value (blank counts as unset, as in
    the readers above), rather than leaving it at its default."""
    if name not in _VARIABLES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = os.environ.get(name)
    return value is not None and bool(value.strip())


def __dir__() -> list[str]:
    return list(__all__)
