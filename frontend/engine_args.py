"""Engine arguments as vLLM's CLI flags: one helper adds them to a parser, one turns the parsed
namespace into an EngineConfig (flags not given keep EngineConfig's defaults)."""
from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from tidal.protocol.config import EngineConfig

# (flags, EngineConfig field, argparse kwargs)
_ENGINE_ARGS: list[tuple[tuple[str, ...], str, dict[str, Any]]] = [
    (("--tokenizer",), "tokenizer", dict(help="tokenizer directory (default: the model's)")),
    (("--dtype",), "dtype", dict(help="auto | float32 | bfloat16 | float16")),
    (("--load-format",), "load_format", dict(choices=["auto", "safetensors", "dummy"],
                                             help="dummy: random weights from config.json")),
    (("--seed",), "seed", dict(type=int, help="engine seed")),
    (("--max-model-len",), "max_model_len", dict(type=int, help="default: the model's max_position_embeddings")),
    (("--max-num-seqs",), "max_num_seqs", dict(type=int)),
    (("--max-num-batched-tokens",), "max_num_batched_tokens", dict(type=int)),
    (("--block-size",), "block_size", dict(type=int)),
    (("--num-kv-blocks", "--num-gpu-blocks-override"), "num_kv_blocks", dict(type=int)),
    (("--kv-cache-memory-bytes",), "kv_cache_memory_bytes", dict(type=int)),
    (("--gpu-memory-utilization",), "gpu_memory_utilization", dict(type=float)),
    (("--enable-prefix-caching",), "enable_prefix_caching", dict(action=argparse.BooleanOptionalAction)),
    (("--enable-chunked-prefill",), "enable_chunked_prefill", dict(action=argparse.BooleanOptionalAction)),
    (("--max-logprobs",), "max_logprobs", dict(type=int)),
    (("--tensor-parallel-size", "-tp"), "tensor_parallel_size", dict(type=int)),
    (("--device",), "device", dict(choices=["auto", "cpu", "cuda"])),
    (("--engine-start-timeout-s",), "engine_start_timeout_s", dict(type=float)),
    (("--worker-step-timeout-s",), "worker_step_timeout_s", dict(type=float)),
    (("--trust-remote-code",), "trust_remote_code", dict(action="store_true")),
    (("--model-runner",), "model_runner", dict(choices=["torch", "null"],
                                               help="null: answer at once without a model (benchmarks)")),
]


def add_engine_args(parser: argparse.ArgumentParser, *, exclude: frozenset[str] = frozenset()) -> None:
    """Add the engine flags (those whose EngineConfig field is not in `exclude`)."""
    group = parser.add_argument_group("engine arguments")
    for flags, dest, kwargs in _ENGINE_ARGS:
        if dest not in exclude:
            # SUPPRESS: a flag that was not given leaves no attribute, so EngineConfig's
            # default applies instead of a second copy of it here.
            group.add_argument(*flags, dest=dest, default=argparse.SUPPRESS, **kwargs)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    known = {f.name for f in fields(EngineConfig)}
    # None never overrides a default (a subcommand may own a flag of the same name).
    kwargs = {dest: v for _, dest, _ in _ENGINE_ARGS if (v := getattr(args, dest, None)) is not None}
    kwargs.update({k: v for k, v in overrides.items() if k in known})
    return EngineConfig(**kwargs)
