"""Engine configuration: vLLM's engine-arg names, one frozen record that crosses processes.

It travels to the engine core and workers as JSON (msgspec), never pickled.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from tidal.protocol.config_views import VllmConfigAttrs

# config.json "architectures" tidal implements (tidal.worker.models.registry maps them to
# classes); kept here, torch-free, so a front-end rejects a model before starting any process.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # like vLLM's VLLM_CPU_KVCACHE_SPACE default ballpark
CORE_RESTART_WINDOW_S = 600.0  # max_core_restarts counts the restarts within this window


_CHOICES: dict[str, tuple[str, ...]] = {
    "tokenizer_mode": ("auto", "hf", "slow"),
    "scheduling_policy": ("fcfs", "priority"),
    "logprobs_mode": ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
    "kv_cache_dtype": ("auto", "float32", "bfloat16", "float16"),
    "generation_config": ("auto", "vllm"),
}


@dataclass(frozen=True)
class EngineConfig(VllmConfigAttrs):
    """What the engine core and workers need; built by EngineArgs.create_engine_config() from
    vLLM's engine args. It doubles as tidal's VllmConfig: `.model_config`, `.cache_config`, ...
    are read-only views under vLLM's names (config_views.py)."""

    model: str = ""
    tokenizer: str | None = None
    dtype: str = "auto"
    load_format: str = "auto"  # auto | safetensors | dummy
    seed: int = 0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # without chunked prefill, raised to max_model_len
    block_size: int = 16
    num_kv_blocks: int | None = None  # vLLM's num_gpu_blocks_override
    kv_cache_memory_bytes: int | None = None  # None: a share of free device memory, or 2 GiB on CPU
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_logprobs: int = 20
    tensor_parallel_size: int = 1
    device: str = "auto"  # auto | cpu | cuda
    worker_step_timeout_s: float = 120.0
    engine_start_timeout_s: float = 300.0
    core_address: str | None = None  # connect to an engine core started with `tidal core`
    trust_remote_code: bool = False
    disable_log_stats: bool = True
    # "torch": the real model runner; "null": a torch-free stand-in that returns one token per
    # request at once (front-end benchmarks and process tests that must not pay for a model).
    model_runner: str = "torch"
    # vLLM engine args that mean something here (EngineArgs maps the rest: no-op or refused).
    tokenizer_mode: str = "auto"  # auto | hf (fast tokenizer) | slow
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only, no text out
    revision: str | None = None  # model revision on the hub (local directories ignore it)
    tokenizer_revision: str | None = None
    enforce_eager: bool = False  # no CUDA graphs (the CPU path never captures any)
    # Decode batch sizes to capture CUDA graphs for (None: vLLM's grid up to max_num_seqs);
    # the front-end resolves vLLM's cuda_graph_sizes / cudagraph_capture_sizes /
    # max_cudagraph_capture_size into this list.
    cuda_graph_sizes: list[int] | None = None
    kv_cache_dtype: str = "auto"  # auto: the model's dtype
    scheduling_policy: str = "fcfs"  # fcfs | priority
    # auto: default sampling params from the model's generation_config.json (vLLM); vllm: none
    generation_config: str = "auto"
    logprobs_mode: str = "raw_logprobs"  # raw_logprobs | raw_logits | processed_logprobs | processed_logits
    served_model_name: str | list[str] | None = None  # the name(s) the API answers to; None: model
    # A peer (the core, or a front-end of a headless core) whose host answers no ZMTP heartbeat
    # for this long is given up: its streams fail with EngineDeadError, or its requests are freed.
    heartbeat_timeout_s: float = 20.0
    # Fault tolerance: a spawned core that dies is restarted and its streams resumed, at most
    # this many times within CORE_RESTART_WINDOW_S (0: a dead core is EngineDeadError at once).
    max_core_restarts: int = 3
    # A front-end of a headless core (core_address) that lost it waits this long for a core to
    # answer on the same address again, then resumes its streams there (or EngineDeadError).
    core_reconnect_timeout_s: float = 30.0
    # ZeroMQ CURVE key file of a headless core (`tidal core --key-file`); required to bind a
    # non-loopback address, and a front-end must hold the same file to connect.
    core_key_file: str | None = None
    # Admission control: over this many waiting requests, new ones fail at once with
    # EngineOverloadedError (None: unlimited, as vLLM).
    max_waiting_requests: int | None = None
    # vLLM's stream_interval: a stream's outputs (DELTA and CUMULATIVE) go out at its first
    # token, then once per this many tokens, and at its end (front-end only; 1: every step).
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.cuda_graph_sizes is not None and any(s < 1 for s in self.cuda_graph_sizes):
            raise ValueError(f"cuda_graph_sizes must be batch sizes >= 1, got {self.cuda_graph_sizes}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}.")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}.")
        if self.model_runner not in ("torch", "null"):
            raise ValueError(f"model_runner must be torch or null, got {self.model_runner!r}.")
        if not 0 < self.heartbeat_timeout_s <= 3600:
            raise ValueError(f"heartbeat_timeout_s must be in (0, 3600], got {self.heartbeat_timeout_s}.")
        if self.max_core_restarts < 0:
            raise ValueError(f"max_core_restarts must be >= 0, got {self.max_core_restarts}.")
        if not 0 <= self.core_reconnect_timeout_s <= 3600:
            raise ValueError(f"core_reconnect_timeout_s must be in [0, 3600], got {self.core_reconnect_timeout_s}.")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {self.max_waiting_requests}.")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {self.stream_interval}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}.")

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    def replace(self, **changes: Any) -> "EngineConfig":
        return dataclasses.replace(self, **changes)

    def to_json(self) -> bytes:
        return msgspec.json.encode(self)

    @classmethod
    def from_json(cls, data: bytes | str) -> "EngineConfig":
        return msgspec.json.decode(data, type=cls)


def read_model_limits(model: str) -> tuple[int, int]:
    """(vocab_size, max_position_embeddings) from a checkpoint's config.json, without torch."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model!r}")
    with open(path) as f:
        cfg = json.load(f)
    text_cfg = cfg.get("text_config", cfg)
    return int(text_cfg["vocab_size"]), int(text_cfg.get("max_position_embeddings", 2048))


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    """The context length to serve: the model's own when none is asked for; a ValueError
    naming both numbers when more is asked than the model's positions cover."""
    if requested is not None and requested > model_max:
        raise ValueError(f"max_model_len {requested} is larger than the model's "
                         f"max_position_embeddings {model_max}; pass --max-model-len {model_max} or less")
    return requested or model_max


def check_model(config: EngineConfig) -> None:
    """Before any process starts, a ValueError for what config.json already rules out: no
    architecture tidal implements (the supported ones are named), a max_model_len above the
    model's. Anything else wrong with the checkpoint (no config.json, unreadable JSON, missing
    keys) is left to the loader, whose error names it."""
    try:
        with open(os.path.join(config.model, "config.json")) as f:
            raw = json.load(f)
        archs = raw.get("architectures")
        model_max = int(raw.get("text_config", raw).get("max_position_embeddings", 2048))
    except (OSError, ValueError, AttributeError, TypeError):
        return
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"unsupported model architecture(s) {archs} in {config.model!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    resolve_max_model_len(config.max_model_len, model_max)


# vLLM's name for the whole engine configuration (see EngineConfig's docstring).
VllmConfig = EngineConfig


@dataclass(frozen=True)
class ResolvedEngineInfo:
    """What the core tells the front-end after start-up (its final limits)."""

    max_model_len: int
    num_kv_blocks: int
    block_size: int
    vocab_size: int
    device: str = "cpu"  # where the model computes: cpu | cuda (the null runner: cpu, the core's own loop)
