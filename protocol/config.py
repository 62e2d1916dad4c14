"""Engine configuration: vLLM's engine-arg names, one frozen record that crosses processes.

It travels to the engine core and workers as JSON (msgspec), never pickled.
"""
from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import msgspec

from tidal.protocol.config_views import VllmConfigAttrs
from tidal.protocol.speculative import SpeculativeConfig

# config.json "architectures" tidal implements (tidal.worker.models.registry maps them to
# classes); kept here, torch-free, so a front-end rejects a model before starting any process.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM",
                           "Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration",
                           "GptOssForCausalLM")
DEFAULT_CPU_KV_CACHE_BYTES = 2 << 30  # like vLLM's VLLM_CPU_KVCACHE_SPACE default ballpark
CORE_RESTART_WINDOW_S = 600.0  # max_core_restarts counts the restarts within this window
# The most whitespace characters a JSON grammar allows in one gap between tokens ("{", keys,
# ":", values, ",") unless an engine or request setting says otherwise. Without a bound, a
# model whose vocabulary has long whitespace tokens (code-trained BPE: runs of 2-16 spaces) can
# spend every token on whitespace after "{" and never close the object. 20 is llama.cpp's
# json.gbnf bound (a newline and 20 spaces or tabs): pretty-printed JSON still fits (a newline
# plus indent=2 to depth 9, indent=4 to depth 4), while a whitespace run is over in a few tokens.
DEFAULT_MAX_WHITESPACE_CNT = 20
DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S = 30.0
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar")  # vLLM's names of the one backend tidal has


_CHOICES: dict[str, tuple[str, ...]] = {
    "tokenizer_mode": ("auto", "hf", "slow"),
    "scheduling_policy": ("fcfs", "priority"),
    "logprobs_mode": ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"),
    "kv_cache_dtype": ("auto", "float32", "bfloat16", "float16"),
    "generation_config": ("auto", "vllm"),
    "distributed_executor_backend": ("mp", "uni", "ray"),
    "data_parallel_backend": ("mp", "ray"),
}


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's StructuredOutputsConfig (the engine-wide structured-output settings, engine arg
    `structured_outputs_config`) and tidal's whitespace bound. Per-request settings of the same
    names (StructuredOutputsParams) take precedence: `disable_any_whitespace` is on when either
    sets it, a request's `max_whitespace_cnt` replaces this one."""

    backend: str = "auto"  # auto | xgrammar: tidal's only backend either way
    disable_fallback: bool = False  # accepted: with one backend there is nothing to fall back to
    # JSON without free whitespace: xgrammar's any_whitespace=False (separators ", " and ": ").
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False  # vLLM's guidance-only option (xgrammar is strict)
    reasoning_parser: str = ""  # not supported: refused unless empty
    reasoning_parser_plugin: str = ""
    enable_in_reasoning: bool = False
    # tidal's: the most whitespace characters between two JSON tokens (None: unbounded, as vLLM).
    max_whitespace_cnt: int | None = DEFAULT_MAX_WHITESPACE_CNT

    def __post_init__(self) -> None:
        if self.backend not in STRUCTURED_OUTPUTS_BACKENDS:
            raise ValueError(f"structured_outputs_config.backend={self.backend!r}: tidal's only structured-output "
                             f"backend is xgrammar (use one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)})")
        for name in ("disable_fallback", "disable_any_whitespace", "disable_additional_properties",
                     "enable_in_reasoning"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs_config.{name} must be a bool, got {getattr(self, name)!r}")
        if self.reasoning_parser or self.reasoning_parser_plugin or self.enable_in_reasoning:
            raise ValueError("structured_outputs_config: tidal does not support reasoning parsers "
                             "(reasoning_parser, reasoning_parser_plugin, enable_in_reasoning)")
        check_max_whitespace_cnt("structured_outputs_config.max_whitespace_cnt", self.max_whitespace_cnt)

    @classmethod
    def from_value(cls, value: "StructuredOutputsConfig | dict[str, Any] | None") -> "StructuredOutputsConfig":
        """The engine arg's value (a dict, as on the CLI, or one of these) as a config; unknown
        keys are a ValueError naming the known ones."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls()
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs_config must be a dict (JSON object), got {type(value).__name__}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"structured_outputs_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(known)}")
        return cls(**value)


def check_max_whitespace_cnt(name: str, value: object) -> None:
    """ValueError unless `value` is None or an int >= 1 (xgrammar's rule)."""
    if value is not None and (type(value) is not int or value < 1):
        raise ValueError(f"{name} must be an integer >= 1 or None, got {value!r}")


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
    # vLLM's: full attention on sliding-window layers, max_model_len then capped at the window.
    disable_sliding_window: bool = False
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
    quantization: str | None = None  # "int8": CPU linear layers quantized at load (worker/layers/quantization.py)
    enforce_eager: bool = False  # no CUDA graphs, and no recorded CPU decode steps (worker/cpu_graphs.py)
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
    # vLLM's structured_outputs_config (engine-wide JSON whitespace rules, tidal's bound).
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    # tidal's: a structured-output grammar whose compile runs longer than this fails its
    # request alone (the compile is stopped); the other requests are not held up.
    grammar_compile_timeout_s: float = DEFAULT_GRAMMAR_COMPILE_TIMEOUT_S
    # vLLM's speculative_config, resolved (tidal.protocol.speculative): n-gram proposals verified
    # by exact match with the target's own sample, so outputs never change. None: off.
    speculative_config: SpeculativeConfig | None = None
    # vLLM's distributed_executor_backend: "mp" (one process per rank; in the core's own process
    # at tensor_parallel_size=1), "uni" (one rank, in the core's process) or "ray" (the ranks as
    # Ray actors, placed by Ray: tidal.core.ray_executor).
    distributed_executor_backend: str = "mp"
    # vLLM's data_parallel_size: that many engine cores (each with its own tensor-parallel
    # ranks) behind one front-end, which routes each request to the least loaded one
    # (frontend/dp_client.py). data_parallel_rank is a core's own index, set by the front-end
    # for each core it starts (it offsets the core's devices and labels its outputs).
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    # Engines on other hosts (vLLM's flags): this host runs data_parallel_size_local engines
    # (None: all) from data_parallel_start_rank on; the head (start rank 0) takes the other
    # hosts' registrations at data_parallel_address:data_parallel_rpc_port (frontend/dp_remote.py,
    # core/dp_node.py). A core's CPU share and devices follow its index among this host's.
    data_parallel_size_local: int | None = None
    data_parallel_start_rank: int | None = None
    data_parallel_address: str | None = None
    data_parallel_rpc_port: int | None = None
    data_parallel_backend: str = "mp"  # "ray": the engines placed by Ray (core/ray_engines.py)
    # The data-parallel engines run already, headless at these addresses (one per rank): set
    # for each of `tidal serve --api-server-count N`'s servers (frontend/entrypoints/api_servers.py).
    engine_core_addresses: list[str] | None = None
    # Tensor parallelism across hosts (vLLM's nnodes / node_rank / master_addr / master_port):
    # tensor_parallel_size // nnodes ranks per node; node 0 runs the engine core, which serves
    # the rendezvous store at master_addr:master_port and the other nodes' registration at
    # master_port + 1 (core/multinode.py); a node K > 0 runs `tidal serve --headless`.
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 29501

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}.")
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}.")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in [0, {self.data_parallel_size}), "
                             f"got {self.data_parallel_rank}.")
        if self.engine_core_addresses is not None and len(self.engine_core_addresses) != self.data_parallel_size:
            raise ValueError(f"engine_core_addresses names {len(self.engine_core_addresses)} engines for "
                             f"data_parallel_size={self.data_parallel_size}")
        local, start = self.dp_local_size, self.data_parallel_start_rank or 0
        if not (1 <= local <= self.data_parallel_size and 0 <= start <= self.data_parallel_size - local):
            raise ValueError(f"data_parallel_size_local={local} from data_parallel_start_rank={start} does not fit "
                             f"data_parallel_size={self.data_parallel_size}")
        if start == 0 and local < self.data_parallel_size and (
                self.data_parallel_address is None or self.data_parallel_rpc_port is None):
            raise ValueError("engines on other hosts (data_parallel_size_local < data_parallel_size) register at "
                             "data_parallel_address:data_parallel_rpc_port: give both")
        if self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes), got node_rank={self.node_rank}, nnodes={self.nnodes}.")
        if self.nnodes > 1:
            if self.tensor_parallel_size % self.nnodes:
                raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be a multiple of "
                                 f"nnodes={self.nnodes} (each node runs as many ranks)")
            if self.distributed_executor_backend != "mp" or self.data_parallel_size > 1:
                raise ValueError("nnodes > 1 runs the tensor-parallel ranks as processes on each node "
                                 "(distributed_executor_backend='mp', data_parallel_size=1)")
            if not 0 < self.master_port < 65535:
                raise ValueError(f"master_port must be in (0, 65535), got {self.master_port}.")
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
        if not 0 < self.grammar_compile_timeout_s <= 3600:
            raise ValueError(f"grammar_compile_timeout_s must be in (0, 3600], got {self.grammar_compile_timeout_s}.")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}.")
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}.")

    @property
    def dp_local_size(self) -> int:
        """The data-parallel engines this host runs."""
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def dp_local_index(self) -> int:
        """This core's index among its host's engines (its CPU share, its device group)."""
        return self.data_parallel_rank - (self.data_parallel_start_rank or 0)

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


def model_positions(text_cfg: Mapping[str, Any], disable_sliding_window: bool = False) -> int:
    """Positions a checkpoint's config (a dict of config.json's text part) lets the engine
    serve: max_position_embeddings, stretched by a RoPE scaling that extends the context, as
    vLLM derives it: linear and dynamic multiply it by `factor`, yarn multiplies
    original_max_position_embeddings (else max_position_embeddings) by it. llama3 and longrope
    configs already state the extended length in max_position_embeddings, as Gemma 3's do
    whatever their scaling (vLLM's exception). With
    `disable_sliding_window` a model with sliding layers serves no more than its (smallest)
    window, as in vLLM: past it, full attention is not what the model was trained for."""
    positions = _rope_positions(text_cfg)
    if disable_sliding_window:
        from tidal.protocol.sliding_window import layer_sliding_windows

        windows = [w for w in layer_sliding_windows(SimpleNamespace(**text_cfg)) if w is not None]
        positions = min([positions, *windows])
    return positions


# transformers' defaults for the fields this module reads, per model_type, where a checkpoint's
# config.json may leave them out: Gemma 3's multimodal configs state only a few text_config
# fields (Gemma3TextConfig fills the rest).
_TEXT_CONFIG_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {"vocab_size": 262_208, "max_position_embeddings": 131_072, "num_hidden_layers": 26,
                    "sliding_window": 4096},
}
# Model types whose max_position_embeddings already is the context their RoPE scaling extends
# to (vLLM's exception for Gemma 3: its 128K is the scaled length; multiplying again is wrong).
_SCALED_MAX_POSITIONS = ("gemma3", "gemma3_text")


def text_config_of(raw: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's text part (`text_config` of a multimodal checkpoint, else the whole), with
    transformers' defaults (_TEXT_CONFIG_DEFAULTS) for the fields it leaves out."""
    text = raw.get("text_config")
    text = dict(text) if isinstance(text, Mapping) else dict(raw)
    if isinstance(raw.get("text_config"), Mapping):
        if raw.get("model_type") == "gemma3":
            text.setdefault("model_type", "gemma3_text")
        text.setdefault("architectures", raw.get("architectures"))
    for key, value in _TEXT_CONFIG_DEFAULTS.get(str(text.get("model_type")), {}).items():
        text.setdefault(key, value)
    return text


def _rope_positions(text_cfg: Mapping[str, Any]) -> int:
    max_pos = int(text_cfg.get("max_position_embeddings", 2048))
    if text_cfg.get("model_type") in _SCALED_MAX_POSITIONS:
        return max_pos
    scaling = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling")
    if not isinstance(scaling, Mapping):
        return max_pos
    rope_type, factor = scaling.get("rope_type", scaling.get("type")), scaling.get("factor")
    if rope_type not in ("linear", "dynamic", "yarn") or not isinstance(factor, (int, float)) or factor <= 1:
        return max_pos
    base = int(scaling.get("original_max_position_embeddings") or max_pos) if rope_type == "yarn" else max_pos
    return int(base * factor)


_POSITION_FIELDS = ("max_position_embeddings", "rope_parameters", "rope_scaling", "num_hidden_layers",
                    "architectures", "model_type", "sliding_window", "use_sliding_window", "max_window_layers",
                    "layer_types")


def config_positions(hf_config: Any, disable_sliding_window: bool = False) -> int:
    """model_positions of a loaded config object (transformers' or the plain reader's)."""
    fields = {f: getattr(hf_config, f) for f in _POSITION_FIELDS if getattr(hf_config, f, None) is not None}
    return model_positions(fields, disable_sliding_window)


def read_model_limits(model: str, disable_sliding_window: bool = False) -> tuple[int, int]:
    """(vocab_size, positions served: model_positions) from a checkpoint's config.json, without torch."""
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.json in model directory {model!r}")
    with open(path) as f:
        cfg = json.load(f)
    text_cfg = text_config_of(cfg)
    return int(text_cfg["vocab_size"]), model_positions(text_cfg, disable_sliding_window)


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    """The context length to serve: the model's own when none is asked for; a ValueError
    naming both numbers when more is asked than the model's positions cover."""
    if requested is not None and requested > model_max:
        raise ValueError(f"max_model_len {requested} is larger than the model's "
                         f"max_position_embeddings {model_max} (RoPE scaling included); "
                         f"pass --max-model-len {model_max} or less")
    return requested or model_max


def check_checkpoint_quantization(raw: Mapping[str, Any]) -> None:
    """A ValueError for a checkpoint whose weights are stored quantized in a format tidal
    cannot read: MXFP4 (gpt-oss's published experts, `*_blocks` / `*_scales` tensors), which
    would otherwise fail later as a pile of missing expert weights."""
    quant = raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else getattr(quant, "quant_method", None)
    if isinstance(method, str) and method.lower() == "mxfp4":
        raise ValueError("this checkpoint's weights are MXFP4-quantized (quantization_config.quant_method "
                         "'mxfp4'), which tidal does not support; use a bf16 checkpoint of the model "
                         "(bf16 and fp32 checkpoints load)")


def check_model(config: EngineConfig) -> None:
    """Before any process starts, a ValueError for what config.json already rules out: no
    architecture tidal implements (the supported ones are named), weights quantized in a format
    tidal cannot read (check_checkpoint_quantization), a max_model_len above the model's.
    Anything else wrong with the checkpoint (no config.json, unreadable JSON, missing keys) is
    left to the loader, whose error names it."""
    try:
        with open(os.path.join(config.model, "config.json")) as f:
            raw = json.load(f)
        archs = raw.get("architectures")
        model_max = model_positions(text_config_of(raw), config.disable_sliding_window)
    except (OSError, ValueError, AttributeError, TypeError):
        return
    if archs and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
        raise ValueError(f"unsupported model architecture(s) {archs} in {config.model!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if isinstance(raw, Mapping):
        check_checkpoint_quantization(raw)
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
