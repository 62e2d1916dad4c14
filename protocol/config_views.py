"""Read-only views of an EngineConfig under vLLM's config names (VllmConfig's sub-configs),
for the code written against vLLM that reads `engine.model_config.max_model_len` and the like.

tidal's EngineConfig *is* its VllmConfig: `VllmConfigAttrs` gives it `.model_config`,
`.cache_config`, `.parallel_config`, ... Only what tidal has is there; features tidal lacks
read as vLLM reads them when off (`lora_config` None, ...). No torch and no transformers at
import: `hf_config` loads lazily, and `dtype` is a torch.dtype only when the application has
imported torch already (comparing with `torch.float16` needs it), else its name.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tidal.protocol.config import EngineConfig


@functools.lru_cache(maxsize=16)
def _load_hf_config(model: str, revision: str | None, trust_remote_code: bool) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model, revision=revision, trust_remote_code=trust_remote_code)


def _config_json_dtype(model: str) -> str | None:
    """The checkpoint's dtype name from config.json (without transformers), or None."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    name = raw.get("dtype") or raw.get("torch_dtype") if isinstance(raw, dict) else None
    return str(name).removeprefix("torch.") if name else None


def resolved_dtype_name(cfg: "EngineConfig") -> str:
    """The model dtype the worker will use, by name: "auto" is the checkpoint's (float32 when
    it names none), as tidal's loader resolves it."""
    if cfg.dtype != "auto":
        return cfg.dtype
    return _config_json_dtype(cfg.model) or "float32"


def _as_dtype(name: str) -> Any:
    torch = sys.modules.get("torch")
    return getattr(torch, name) if torch is not None else name


class ModelConfig:
    """vLLM's ModelConfig attributes for what tidal has."""

    runner_type = "generate"
    is_multimodal_model = False
    is_encoder_decoder = False
    is_hybrid = False
    use_mla = False

    def __init__(self, cfg: "EngineConfig") -> None:
        self._cfg = cfg

    def __getattr__(self, name: str) -> Any:
        # model, seed, max_logprobs, logprobs_mode, skip_tokenizer_init, enforce_eager,
        # trust_remote_code, revision, tokenizer_revision, tokenizer_mode: same names.
        if name.startswith("_") or name not in _MODEL_FIELDS:
            raise AttributeError(f"tidal's ModelConfig has no attribute {name!r}")
        return getattr(self._cfg, name)

    @property
    def tokenizer(self) -> str:
        return self._cfg.tokenizer_path

    @property
    def served_model_name(self) -> str:
        name = self._cfg.served_model_name
        if isinstance(name, list):
            return name[0] if name else self._cfg.model
        return name or self._cfg.model

    @property
    def hf_config(self) -> Any:
        cfg = self._cfg
        return _load_hf_config(cfg.model, cfg.revision, cfg.trust_remote_code)

    @property
    def hf_text_config(self) -> Any:
        hf = self.hf_config
        return hf.get_text_config() if hasattr(hf, "get_text_config") else hf

    @property
    def max_model_len(self) -> int:
        if self._cfg.max_model_len is not None:
            return self._cfg.max_model_len
        from tidal.protocol.config import config_positions  # config.py imports this module

        return config_positions(self.hf_text_config, self._cfg.disable_sliding_window)

    @property
    def dtype(self) -> Any:
        return _as_dtype(resolved_dtype_name(self._cfg))

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def architecture(self) -> str:
        return self.architectures[0] if self.architectures else ""

    def get_vocab_size(self) -> int:
        return int(getattr(self.hf_text_config, "vocab_size", 0))

    def get_hidden_size(self) -> int:
        return int(getattr(self.hf_text_config, "hidden_size", 0))

    def get_head_size(self) -> int:
        t = self.hf_text_config
        return int(getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads)

    def get_num_layers(self, parallel_config: Any = None) -> int:
        return int(self.hf_text_config.num_hidden_layers)

    def get_num_attention_heads(self, parallel_config: Any = None) -> int:
        return int(self.hf_text_config.num_attention_heads) // _tp(parallel_config)

    def get_num_kv_heads(self, parallel_config: Any = None) -> int:
        t = self.hf_text_config
        total = int(getattr(t, "num_key_value_heads", None) or t.num_attention_heads)
        return max(1, total // _tp(parallel_config))

    def get_sliding_window(self) -> int | None:
        """vLLM's: the model's sliding window (None: every layer attends the full context)."""
        from tidal.protocol.sliding_window import layer_sliding_windows

        if self._cfg.disable_sliding_window:
            return None

        windows = [w for w in layer_sliding_windows(self.hf_text_config) if w is not None]
        return max(windows) if windows else None

    def get_diff_sampling_param(self) -> dict[str, Any]:
        """vLLM's: the sampling defaults the model's generation_config.json sets (with
        generation_config="auto"), under SamplingParams' names; {} when none (or "vllm")."""
        if self._cfg.generation_config != "auto" or not os.path.isdir(self._cfg.model):
            return {}
        try:
            with open(os.path.join(self._cfg.model, "generation_config.json"), encoding="utf-8") as f:
                gen = json.load(f)
        except (OSError, ValueError):
            return {}
        if not isinstance(gen, dict):
            return {}
        names = {"repetition_penalty": "repetition_penalty", "temperature": "temperature", "top_k": "top_k",
                 "top_p": "top_p", "min_p": "min_p", "max_new_tokens": "max_tokens"}
        return {ours: gen[theirs] for theirs, ours in names.items() if gen.get(theirs) is not None}


_MODEL_FIELDS = frozenset({"model", "seed", "generation_config", "max_logprobs", "logprobs_mode", "skip_tokenizer_init",
                           "enforce_eager", "trust_remote_code", "revision", "tokenizer_revision",
                           "tokenizer_mode", "quantization"})


def _tp(parallel_config: Any) -> int:
    return int(getattr(parallel_config, "tensor_parallel_size", 1) or 1)


class CacheConfig:
    def __init__(self, cfg: "EngineConfig") -> None:
        self.block_size = cfg.block_size
        self.gpu_memory_utilization = cfg.gpu_memory_utilization
        self.cache_dtype = cfg.kv_cache_dtype
        self.enable_prefix_caching = cfg.enable_prefix_caching
        self.kv_cache_memory_bytes = cfg.kv_cache_memory_bytes
        self.num_gpu_blocks = cfg.num_kv_blocks  # the front-end's view: what the core allocated
        self.num_gpu_blocks_override = cfg.num_kv_blocks
        self.swap_space = 0.0
        self.cpu_offload_gb = 0.0


class ParallelConfig:
    pipeline_parallel_size = 1

    def __init__(self, cfg: "EngineConfig") -> None:
        self.data_parallel_size = cfg.data_parallel_size
        self.data_parallel_size_local = cfg.data_parallel_size
        self.data_parallel_rank = cfg.data_parallel_rank
        self.distributed_executor_backend = cfg.distributed_executor_backend
        self.tensor_parallel_size = cfg.tensor_parallel_size
        self.world_size = cfg.tensor_parallel_size


class SchedulerConfig:
    def __init__(self, cfg: "EngineConfig") -> None:
        self.max_num_seqs = cfg.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.max_model_len = cfg.max_model_len
        self.enable_chunked_prefill = cfg.enable_chunked_prefill
        self.policy = cfg.scheduling_policy
        self.async_scheduling = False


class DeviceConfig:
    def __init__(self, cfg: "EngineConfig") -> None:
        self.device_type = cfg.device  # "auto" until a worker picked (cuda if it sees one)
        self.device = cfg.device


class LoadConfig:
    download_dir = None

    def __init__(self, cfg: "EngineConfig") -> None:
        self.load_format = cfg.load_format


class VllmConfigAttrs:
    """vLLM's VllmConfig attributes, mixed into EngineConfig (self is the EngineConfig)."""

    lora_config = None
    speculative_config = None
    quant_config = None
    kv_transfer_config = None
    kv_events_config = None
    ec_transfer_config = None

    @property
    def model_config(self) -> ModelConfig:
        return ModelConfig(self)  # type: ignore[arg-type]

    @property
    def cache_config(self) -> CacheConfig:
        return CacheConfig(self)  # type: ignore[arg-type]

    @property
    def parallel_config(self) -> ParallelConfig:
        return ParallelConfig(self)  # type: ignore[arg-type]

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self)  # type: ignore[arg-type]

    @property
    def device_config(self) -> DeviceConfig:
        return DeviceConfig(self)  # type: ignore[arg-type]

    @property
    def load_config(self) -> LoadConfig:
        return LoadConfig(self)  # type: ignore[arg-type]

    @property
    def additional_config(self) -> dict[str, Any]:
        return {}
