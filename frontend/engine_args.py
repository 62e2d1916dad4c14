"""vLLM's `EngineArgs` / `AsyncEngineArgs`: every vLLM 0.12 engine arg, by vLLM's name and
default, plus tidal's own. One object feeds `LLM(**kwargs)`, `AsyncLLM.from_engine_args` and
the CLI (`add_cli_args` / `from_cli_args`, generated from these fields in arg_cli.py).

What each arg does in tidal (implemented, accepted no-op, refused) is declared once, in
arg_rules.RULES; `create_engine_config()` applies it and maps the implemented ones onto the
`EngineConfig` that travels to the engine core. A misspelt name is a TypeError that suggests
the closest known name.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

from tidal.protocol.config import EngineConfig

T = TypeVar("T")


def _d() -> Any:
    return field(default_factory=dict)


def unknown_arg_error(unknown: list[str], known: list[str]) -> TypeError:
    """TypeError naming each unknown engine arg and, where one is close, the known name meant."""
    parts = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        parts.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return TypeError(f"unknown engine argument(s): {', '.join(parts)}")


def _typo_checked(cls: type[T]) -> type[T]:
    """Wrap the dataclass __init__ so an unknown keyword names the closest field (the plain
    dataclass TypeError names only the unknown one)."""
    init = cls.__init__
    known = [f.name for f in fields(cls)]  # type: ignore[arg-type]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        unknown = [k for k in kwargs if k not in known]
        if unknown:
            raise unknown_arg_error(unknown, known)
        init(self, *args, **kwargs)

    cls.__init__ = __init__  # type: ignore[method-assign]
    return cls


@_typo_checked
@dataclass
class EngineArgs:
    """vLLM 0.12's engine args in its declaration order; tidal's extras at the end."""

    model: str = "Qwen/Qwen3-0.6B"
    served_model_name: str | list[str] | None = None
    tokenizer: str | None = None
    hf_config_path: str | None = None
    runner: str = "auto"
    convert: str = "auto"
    task: str | None = None
    skip_tokenizer_init: bool = False
    enable_prompt_embeds: bool = False
    tokenizer_mode: str = "auto"
    trust_remote_code: bool = False
    allowed_local_media_path: str = ""
    allowed_media_domains: list[str] | None = None
    download_dir: str | None = None
    safetensors_load_strategy: str = "lazy"
    load_format: str = "auto"
    config_format: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    seed: int | None = 0
    max_model_len: int | None = None
    cuda_graph_sizes: list[int] | None = None
    cudagraph_capture_sizes: list[int] | None = None
    max_cudagraph_capture_size: int | None = None
    distributed_executor_backend: str | None = None
    pipeline_parallel_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29501
    nnodes: int = 1
    node_rank: int = 0
    tensor_parallel_size: int = 1
    prefill_context_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    dcp_kv_cache_interleave_size: int = 1
    cp_kv_cache_interleave_size: int = 1
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_size_local: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    data_parallel_hybrid_lb: bool = False
    data_parallel_external_lb: bool = False
    data_parallel_backend: str = "mp"
    enable_expert_parallel: bool = False
    all2all_backend: str | None = None
    enable_dbo: bool = False
    dbo_decode_token_threshold: int = 32
    dbo_prefill_token_threshold: int = 512
    disable_nccl_for_dp_synchronization: bool = False
    eplb_config: dict[str, Any] = _d()
    enable_eplb: bool = False
    expert_placement_strategy: str = "linear"
    _api_process_count: int = 1
    _api_process_rank: int = 0
    max_parallel_loading_workers: int | None = None
    block_size: int | None = None
    enable_prefix_caching: bool | None = None
    prefix_caching_hash_algo: str = "sha256"
    disable_sliding_window: bool = False
    disable_cascade_attn: bool = False
    swap_space: float = 4
    cpu_offload_gb: float = 0
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int | None = None
    max_num_partial_prefills: int = 1
    max_long_partial_prefills: int = 1
    long_prefill_token_threshold: int = 0
    max_num_seqs: int | None = None
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    disable_log_stats: bool = False
    aggregate_engine_logging: bool = False
    revision: str | None = None
    code_revision: str | None = None
    hf_token: bool | str | None = None
    hf_overrides: dict[str, Any] = _d()
    tokenizer_revision: str | None = None
    quantization: str | None = None
    enforce_eager: bool = False
    disable_custom_all_reduce: bool = False
    limit_mm_per_prompt: dict[str, Any] = _d()
    enable_mm_embeds: bool = False
    interleave_mm_strings: bool = False
    media_io_kwargs: dict[str, Any] = _d()
    mm_processor_kwargs: dict[str, Any] | None = None
    disable_mm_preprocessor_cache: bool = False
    mm_processor_cache_gb: float = 4
    mm_processor_cache_type: str | None = "lru"
    mm_shm_cache_max_object_size_mb: int = 128
    mm_encoder_tp_mode: str = "weights"
    mm_encoder_attn_backend: str | None = None
    io_processor_plugin: str | None = None
    skip_mm_profiling: bool = False
    video_pruning_rate: float | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    default_mm_loras: dict[str, str] | None = None
    fully_sharded_loras: bool = False
    max_cpu_loras: int | None = None
    lora_dtype: str | None = "auto"
    ray_workers_use_nsight: bool = False
    num_gpu_blocks_override: int | None = None
    model_loader_extra_config: dict[str, Any] = _d()
    ignore_patterns: str | list[str] = field(default_factory=lambda: ["original/**/*"])
    enable_chunked_prefill: bool | None = None
    disable_chunked_mm_input: bool = False
    disable_hybrid_kv_cache_manager: bool = False
    # vLLM's StructuredOutputsConfig as a dict (CLI: JSON), or a tidal.protocol.config
    # StructuredOutputsConfig: backend (auto | xgrammar), disable_any_whitespace, and tidal's
    # max_whitespace_cnt (the most whitespace between two JSON tokens; default 20, None: no bound).
    structured_outputs_config: dict[str, Any] = _d()
    reasoning_parser: str = ""
    reasoning_parser_plugin: str | None = None
    logits_processor_pattern: str | None = None
    speculative_config: dict[str, Any] | None = None
    show_hidden_metrics_for_version: str | None = None
    otlp_traces_endpoint: str | None = None
    collect_detailed_traces: list[str] | None = None
    kv_cache_metrics: bool = False
    kv_cache_metrics_sample: float = 0.01
    scheduling_policy: str = "fcfs"
    scheduler_cls: str | None = None
    pooler_config: dict[str, Any] | None = None
    compilation_config: int | dict[str, Any] | None = _d()
    worker_cls: str = "auto"
    worker_extension_cls: str = ""
    kv_transfer_config: dict[str, Any] | None = None
    kv_events_config: dict[str, Any] | None = None
    ec_transfer_config: dict[str, Any] | None = None
    generation_config: str = "auto"
    enable_sleep_mode: bool = False
    override_generation_config: dict[str, Any] = _d()
    model_impl: str = "auto"
    override_attention_dtype: str | None = None
    calculate_kv_scales: bool = False
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    mamba_block_size: int | None = None
    additional_config: dict[str, Any] = _d()
    use_tqdm_on_load: bool = True
    pt_load_map_location: str = "cpu"
    enable_multimodal_encoder_data_parallel: bool = False
    logits_processors: list[Any] | None = None
    async_scheduling: bool | None = False
    stream_interval: int = 1
    kv_sharing_fast_prefill: bool = False
    optimization_level: int = 2
    kv_offloading_size: float | None = None
    kv_offloading_backend: str | None = None
    tokens_only: bool = False
    # ---- tidal's own (EngineConfig fields of the same name) ----
    device: str = "auto"  # auto | cpu | cuda
    worker_step_timeout_s: float = 120.0
    engine_start_timeout_s: float = 300.0
    heartbeat_timeout_s: float = 20.0  # a silent core (or front-end) is declared gone after this
    core_address: str | None = None  # a running `tidal core` to connect to
    engine_core_addresses: list[str] | None = None  # running data-parallel engines (one per rank)
    max_core_restarts: int = 3  # a dead core is restarted and its streams resumed (0: off)
    core_reconnect_timeout_s: float = 30.0  # how long a headless core's front-end waits for it
    core_key_file: str | None = None  # CURVE key file of a keyed headless core
    max_waiting_requests: int | None = None  # over it, new requests fail ("engine overloaded")
    model_runner: str = "torch"  # torch | null (no model: one token per request per step)
    num_kv_blocks: int | None = None  # tidal's older name of num_gpu_blocks_override
    # A structured-output grammar (JSON schema, regex, EBNF, ...) whose compile takes longer than
    # this many seconds fails its request alone with an error naming this limit; the compile
    # process is stopped and the engine serves on (vLLM has no such limit).
    grammar_compile_timeout_s: float = 30.0

    # ------------------------------------------------------------------ config
    def create_engine_config(self, usage_context: Any = None, headless: bool = False) -> EngineConfig:
        """The EngineConfig these args describe. Refused args raise ValueError naming the
        feature; no-ops log one warning each (arg_rules.RULES). The result also answers
        vLLM's VllmConfig attributes (`.model_config`, `.cache_config`, ...)."""
        from tidal.frontend.arg_rules import apply_rules, config_kwargs

        apply_rules(self)
        return EngineConfig(**config_kwargs(self))

    def replace(self: T, **changes: Any) -> T:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    # --------------------------------------------------------------------- CLI
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *,
                     exclude: frozenset[str] = frozenset()) -> argparse.ArgumentParser:
        """Add one flag per field (vLLM's spelling; `exclude`: fields a subcommand owns)."""
        from tidal.frontend.arg_cli import add_fields_as_flags

        return add_fields_as_flags(cls, parser, exclude=exclude)

    @classmethod
    def from_cli_args(cls: type[T], args: argparse.Namespace) -> T:
        """The flags given (absent ones keep the field defaults); other attributes are ignored."""
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)  # type: ignore[arg-type]
                      if hasattr(args, f.name)})


@_typo_checked
@dataclass
class AsyncEngineArgs(EngineArgs):
    enable_log_requests: bool = False  # AsyncLLM logs each request it adds

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, async_args_only: bool = False, *,
                     exclude: frozenset[str] = frozenset()) -> argparse.ArgumentParser:
        if async_args_only:
            exclude = frozenset(f.name for f in fields(EngineArgs)) | exclude
        return super().add_cli_args(parser, exclude=exclude)


def config_from_args(args: argparse.Namespace, **overrides: Any) -> EngineConfig:
    """The CLI's EngineConfig: the engine flags given, then `overrides` (values the subcommand
    resolved itself, e.g. the default model)."""
    return EngineArgs.from_cli_args(args).replace(**overrides).create_engine_config()

