"""What each engine arg does in tidal, declared once (RULES), and how it is applied.

* `Implemented(target)`: mapped onto the EngineConfig field `target` (None: the front-end or
  `config_kwargs` resolves it); `refuse` marks values tidal still cannot honour.
* `NoOp(why)`: accepted; a value other than vLLM's default logs one warning saying why it
  changes nothing here.
* `Refused(feature)`: a value other than the default (or than those `ok` accepts) is a
  ValueError naming the feature; `ok` values that are not the default log `why` if given.
"""
from __future__ import annotations

import logging
from dataclasses import MISSING, Field, fields
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from tidal.protocol.config import StructuredOutputsConfig
from tidal.protocol.speculative import SpeculativeConfig
from tidal.protocol.sizing import cuda_graph_capture_sizes

if TYPE_CHECKING:
    from tidal.frontend.engine_args import EngineArgs

logger = logging.getLogger("tidal.engine_args")

Pred = Callable[[Any], bool]


class Implemented(NamedTuple):
    target: str | None
    refuse: Pred | None = None
    feature: str = ""


class NoOp(NamedTuple):
    why: str


class Refused(NamedTuple):
    feature: str
    ok: Pred | None = None
    why: str = ""


Rule = Implemented | NoOp | Refused


def _one_of(*values: Any) -> Pred:
    return lambda v: v in values


def _at_most(limit: int) -> Pred:
    return lambda v: v is None or v <= limit


_GENERATE = "tidal runs every model as a generative one, which is what this asks for"
_MM = "multimodal inputs (tidal serves text-only models)"
_LORA = "LoRA adapters"
_DP = "data parallelism with external or hybrid load balancing (tidal's head front-end routes to every engine)"
_MOE = "tidal's models have no experts (MoE), so expert-parallel settings have nothing to act on"
_MAMBA = "tidal's models have no Mamba layers"
_NO_HUB_LOAD = "tidal loads local checkpoints and the huggingface_hub cache itself"
_SCHED_TUNING = "tidal's scheduler has no separate partial-prefill limits; chunked prefill follows the token budget"

RULES: dict[str, Rule] = {
    # ---- model and tokenizer
    "model": Implemented("model"),
    "served_model_name": Implemented("served_model_name"),
    "tokenizer": Implemented("tokenizer"),
    "hf_config_path": Refused("a config.json from elsewhere than the model directory"),
    "runner": Refused("pooling and draft model runners", ok=_one_of("auto", "generate"), why=_GENERATE),
    "convert": Refused("model conversion adapters (embed/classify/reward)", ok=_one_of("auto", "none"),
                       why=_GENERATE),
    "task": Refused("tasks other than generation", ok=_one_of(None, "auto", "generate"), why=_GENERATE),
    "skip_tokenizer_init": Implemented("skip_tokenizer_init"),
    "enable_prompt_embeds": Refused("prompt embeddings as inputs"),
    "tokenizer_mode": Implemented("tokenizer_mode", refuse=lambda v: v not in ("auto", "hf", "slow"),
                                  feature="tokenizer modes other than auto, hf and slow (mistral, custom)"),
    "trust_remote_code": Implemented("trust_remote_code"),
    "allowed_local_media_path": Refused(_MM),
    "allowed_media_domains": Refused(_MM),
    "download_dir": NoOp(_NO_HUB_LOAD),
    "safetensors_load_strategy": NoOp("tidal reads safetensors the one way it knows"),
    "load_format": Implemented("load_format", refuse=lambda v: v not in ("auto", "safetensors", "dummy"),
                               feature="weight formats other than auto, safetensors and dummy"),
    "config_format": Refused("config formats other than Hugging Face's", ok=_one_of("auto", "hf")),
    "dtype": Implemented("dtype"),
    "kv_cache_dtype": Implemented("kv_cache_dtype", refuse=lambda v: str(v).startswith("fp8"),
                                  feature="an fp8 KV cache"),
    "seed": Implemented("seed"),
    "max_model_len": Implemented("max_model_len"),
    "cuda_graph_sizes": Implemented(None),  # these three: graph_sizes below
    "cudagraph_capture_sizes": Implemented(None),
    "max_cudagraph_capture_size": Implemented(None),
    # ---- parallelism
    "distributed_executor_backend": Implemented(
        "distributed_executor_backend", refuse=lambda v: v not in (None, "mp", "uni", "ray"),
        feature="executors other than mp, uni and ray (external_launcher, executor classes)"),
    "pipeline_parallel_size": Refused("pipeline parallelism", ok=_at_most(1)),
    "master_addr": Implemented("master_addr"),
    "master_port": Implemented("master_port"),
    "nnodes": Implemented("nnodes"),
    "node_rank": Implemented("node_rank"),
    "tensor_parallel_size": Implemented("tensor_parallel_size"),
    "prefill_context_parallel_size": Refused("context parallelism", ok=_at_most(1)),
    "decode_context_parallel_size": Refused("context parallelism", ok=_at_most(1)),
    "dcp_kv_cache_interleave_size": NoOp("it only matters with context parallelism, which tidal lacks"),
    "cp_kv_cache_interleave_size": NoOp("it only matters with context parallelism, which tidal lacks"),
    "data_parallel_size": Implemented("data_parallel_size"),
    "data_parallel_rank": Refused(_DP, ok=_one_of(None, 0)),
    "data_parallel_start_rank": Implemented("data_parallel_start_rank"),
    "data_parallel_size_local": Implemented("data_parallel_size_local"),
    "data_parallel_address": Implemented("data_parallel_address"),
    "data_parallel_rpc_port": Implemented("data_parallel_rpc_port"),
    "data_parallel_hybrid_lb": Refused(_DP),
    "data_parallel_external_lb": Refused(_DP),
    "data_parallel_backend": Implemented("data_parallel_backend", refuse=lambda v: v not in ("mp", "ray"),
                                         feature="data-parallel backends other than mp and ray"),
    "enable_expert_parallel": NoOp(_MOE),
    "all2all_backend": NoOp(_MOE),
    "enable_dbo": NoOp("tidal has no dual-batch overlap; each step runs one batch"),
    "dbo_decode_token_threshold": NoOp("tidal has no dual-batch overlap"),
    "dbo_prefill_token_threshold": NoOp("tidal has no dual-batch overlap"),
    "disable_nccl_for_dp_synchronization": NoOp("tidal has no data parallelism to synchronise"),
    "eplb_config": NoOp(_MOE),
    "enable_eplb": NoOp(_MOE),
    "expert_placement_strategy": NoOp(_MOE),
    "_api_process_count": NoOp("tidal's API server is one process"),
    "_api_process_rank": NoOp("tidal's API server is one process"),
    "max_parallel_loading_workers": NoOp("each tidal rank loads its own shard"),
    # ---- KV cache
    "block_size": Implemented("block_size"),
    "enable_prefix_caching": Implemented("enable_prefix_caching"),
    "prefix_caching_hash_algo": NoOp("tidal keys cached blocks by its own chained hash"),
    "disable_sliding_window": Implemented("disable_sliding_window"),
    "disable_cascade_attn": NoOp("tidal has no cascade attention"),
    "swap_space": NoOp("tidal never swaps KV blocks to CPU memory; a preempted request recomputes"),
    "cpu_offload_gb": Refused("offloading weights to CPU memory", ok=_one_of(0)),
    "gpu_memory_utilization": Implemented("gpu_memory_utilization"),
    "kv_cache_memory_bytes": Implemented("kv_cache_memory_bytes"),
    # ---- scheduler
    "max_num_batched_tokens": Implemented("max_num_batched_tokens"),
    "max_num_partial_prefills": NoOp(_SCHED_TUNING),
    "max_long_partial_prefills": NoOp(_SCHED_TUNING),
    "long_prefill_token_threshold": NoOp(_SCHED_TUNING),
    "max_num_seqs": Implemented("max_num_seqs"),
    "max_logprobs": Implemented("max_logprobs"),
    "logprobs_mode": Implemented("logprobs_mode"),
    "disable_log_stats": Implemented("disable_log_stats"),
    "aggregate_engine_logging": NoOp("tidal runs one engine, so its stats are already the aggregate"),
    "revision": Implemented("revision"),
    "code_revision": NoOp("tidal runs no model code from the hub"),
    "hf_token": NoOp("huggingface_hub reads its token itself (HF_TOKEN or `hf auth login`)"),
    "hf_overrides": Refused("overriding the model's config.json (hf_overrides)"),
    "tokenizer_revision": Implemented("tokenizer_revision"),
    "quantization": Implemented("quantization", refuse=lambda v: v not in (None, "int8"),
                                feature="quantized weights other than int8 (CPU: int8 blocks of 32, made at load)"),
    "enforce_eager": Implemented("enforce_eager"),
    "disable_custom_all_reduce": NoOp("tidal's tensor parallelism always uses torch.distributed's all-reduce"),
    # ---- multimodal
    "limit_mm_per_prompt": Refused(_MM),
    "enable_mm_embeds": Refused(_MM),
    "interleave_mm_strings": Refused(_MM),
    "media_io_kwargs": Refused(_MM),
    "mm_processor_kwargs": Refused(_MM),
    "disable_mm_preprocessor_cache": NoOp("tidal has no multimodal processor to cache"),
    "mm_processor_cache_gb": NoOp("tidal has no multimodal processor to cache"),
    "mm_processor_cache_type": NoOp("tidal has no multimodal processor to cache"),
    "mm_shm_cache_max_object_size_mb": NoOp("tidal has no multimodal processor to cache"),
    "mm_encoder_tp_mode": NoOp("tidal's models have no multimodal encoder"),
    "mm_encoder_attn_backend": NoOp("tidal's models have no multimodal encoder"),
    "io_processor_plugin": Refused("IO processor plugins"),
    "skip_mm_profiling": NoOp("tidal's models have no multimodal encoder to profile"),
    "video_pruning_rate": Refused(_MM),
    # ---- LoRA
    "enable_lora": Refused(_LORA),
    "max_loras": Refused(_LORA),
    "max_lora_rank": Refused(_LORA),
    "default_mm_loras": Refused(_LORA),
    "fully_sharded_loras": Refused(_LORA),
    "max_cpu_loras": Refused(_LORA),
    "lora_dtype": Refused(_LORA),
    "ray_workers_use_nsight": NoOp("tidal uses no Ray workers"),
    "num_gpu_blocks_override": Implemented("num_kv_blocks"),
    "model_loader_extra_config": NoOp("tidal's loader takes no extra options"),
    "ignore_patterns": NoOp("tidal loads the *.safetensors files at the top of the model directory only"),
    "enable_chunked_prefill": Implemented("enable_chunked_prefill"),
    "disable_chunked_mm_input": NoOp("tidal has no multimodal inputs to chunk"),
    "disable_hybrid_kv_cache_manager": NoOp("tidal's models have one kind of attention layer, so one KV cache"),
    "structured_outputs_config": Implemented(None),  # config_kwargs: a StructuredOutputsConfig
    # The server's chat routes read it (ServingContext.reply_parser); tidal serve checks the name.
    "reasoning_parser": Implemented(None),
    "reasoning_parser_plugin": Refused("reasoning parser plugins (the built-in parsers are --reasoning-parser's "
                                       "choices)"),
    "logits_processor_pattern": NoOp("tidal takes no custom logits processors by name"),
    "speculative_config": Implemented(None),  # config_kwargs: a SpeculativeConfig (n-gram or a draft model)
    "show_hidden_metrics_for_version": NoOp("tidal has no hidden (deprecated) metrics"),
    "otlp_traces_endpoint": Refused("OpenTelemetry tracing"),
    "collect_detailed_traces": Refused("OpenTelemetry tracing"),
    "kv_cache_metrics": NoOp("tidal records no KV-block residency metrics"),
    "kv_cache_metrics_sample": NoOp("tidal records no KV-block residency metrics"),
    "scheduling_policy": Implemented("scheduling_policy"),
    "scheduler_cls": Refused("a custom scheduler class"),
    "pooler_config": Refused("pooling models"),
    "compilation_config": NoOp("tidal compiles nothing with torch.compile and captures no CUDA graphs"),
    "worker_cls": Refused("a custom worker class", ok=_one_of("auto")),
    "worker_extension_cls": Refused("worker extension classes"),
    "kv_transfer_config": Refused("KV transfer (disaggregated prefill)"),
    "kv_events_config": Refused("KV cache event publishing"),
    "ec_transfer_config": Refused("encoder-cache transfer"),
    "generation_config": Implemented("generation_config", refuse=lambda v: v not in ("auto", "vllm"),
                                     feature="a generation config from another folder"),
    "enable_sleep_mode": NoOp("tidal has no sleep mode; the engine keeps its memory while idle"),
    "override_generation_config": Refused("default sampling params from a generation config"),
    "model_impl": Refused("the Transformers/Terratorch model backends", ok=_one_of("auto", "vllm")),
    "override_attention_dtype": Refused("an attention dtype other than the model's"),
    "calculate_kv_scales": NoOp("KV scales only matter for an fp8 KV cache, which tidal lacks"),
    "mamba_cache_dtype": NoOp(_MAMBA),
    "mamba_ssm_cache_dtype": NoOp(_MAMBA),
    "mamba_block_size": NoOp(_MAMBA),
    "additional_config": NoOp("tidal has no platform plugins to read it"),
    "use_tqdm_on_load": NoOp("tidal shows no progress bar while loading weights"),
    "pt_load_map_location": NoOp("tidal loads safetensors only, straight onto the device"),
    "enable_multimodal_encoder_data_parallel": NoOp("tidal's models have no multimodal encoder"),
    "logits_processors": Refused("custom logits processors"),
    "async_scheduling": NoOp("tidal's core schedules each step once the previous one's output is in"),
    "stream_interval": Implemented("stream_interval"),
    "kv_sharing_fast_prefill": NoOp("tidal's models share no KV cache across layers"),
    "optimization_level": NoOp("tidal compiles nothing, so there is no optimisation level to pick"),
    "kv_offloading_size": Refused("KV cache offloading"),
    "kv_offloading_backend": Refused("KV cache offloading"),
    "tokens_only": Implemented(None),  # sets skip_tokenizer_init, as in vLLM
    # ---- AsyncEngineArgs
    "enable_log_requests": Implemented(None),  # AsyncLLM logs each request it adds
    # ---- tidal's own
    "device": Implemented("device"),
    "worker_step_timeout_s": Implemented("worker_step_timeout_s"),
    "engine_start_timeout_s": Implemented("engine_start_timeout_s"),
    "heartbeat_timeout_s": Implemented("heartbeat_timeout_s"),
    "core_address": Implemented("core_address"),
    "engine_core_addresses": Implemented("engine_core_addresses"),
    "max_core_restarts": Implemented("max_core_restarts"),
    "core_reconnect_timeout_s": Implemented("core_reconnect_timeout_s"),
    "core_key_file": Implemented("core_key_file"),
    "max_waiting_requests": Implemented("max_waiting_requests"),
    "model_runner": Implemented("model_runner"),
    "num_kv_blocks": Implemented(None),  # tidal's older name of num_gpu_blocks_override
    "grammar_compile_timeout_s": Implemented("grammar_compile_timeout_s"),
}

_EMPTY = (None, {}, [], ())


def field_default(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None  # type: ignore[misc]


def is_default(value: Any, default: Any) -> bool:
    """Equal to the default; None and empty containers count as one another (vLLM's LLM turns
    hf_overrides=None into {}, compilation_config=None into its default, ...)."""
    if value is default or value == default:
        return True
    return any(value is e or (type(value) is type(e) and value == e) for e in _EMPTY) and \
        any(default is e or (type(default) is type(e) and default == e) for e in _EMPTY)


def apply_rules(args: "EngineArgs") -> None:
    """ValueError for the first refused value; one warning per no-op arg set to another value
    than vLLM's default."""
    for f in fields(args):
        rule, value = RULES[f.name], getattr(args, f.name)
        if isinstance(rule, Implemented):
            if rule.refuse is not None and rule.refuse(value):
                raise ValueError(f"{f.name}={value!r}: tidal does not support {rule.feature}")
            continue
        if is_default(value, field_default(f)):
            continue
        if isinstance(rule, NoOp):
            logger.warning("engine arg %s=%r has no effect in tidal: %s", f.name, value, rule.why)
        elif rule.ok is not None and rule.ok(value):
            if rule.why:
                logger.warning("engine arg %s=%r has no effect in tidal: %s", f.name, value, rule.why)
        else:
            raise ValueError(f"{f.name}={value!r}: tidal does not support {rule.feature}")


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}
MODEL_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType


def dtype_name(dtype: Any) -> str:
    """The config's dtype name of vLLM's `dtype` arg: a torch.dtype by its name (the config is
    JSON, and the front-end imports no torch), the aliases by their canonical names; any other
    value is a ValueError listing the accepted ones."""
    if type(dtype).__module__ == "torch" and type(dtype).__name__ == "dtype":
        dtype = str(dtype).removeprefix("torch.")
    if not isinstance(dtype, str) or dtype not in MODEL_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use one of {', '.join(MODEL_DTYPES)} "
                         "(or the torch.dtype of one)")
    return _DTYPE_ALIASES.get(dtype, dtype)


def config_kwargs(args: "EngineArgs") -> dict[str, Any]:
    """EngineConfig keyword arguments from the implemented args. vLLM's late defaults (None)
    are left out so EngineConfig's own defaults apply (block_size 16, max_num_seqs 256,
    max_num_batched_tokens 2048, prefix caching and chunked prefill on); seed None is 0."""
    out: dict[str, Any] = {}
    for f in fields(args):
        rule = RULES[f.name]
        if isinstance(rule, Implemented) and rule.target is not None:
            value = getattr(args, f.name)
            if value is not None:  # EngineConfig's optional fields default to None too
                out[rule.target] = value
    out["seed"] = 0 if args.seed is None else args.seed
    out["dtype"] = dtype_name(args.dtype)
    if args.tokens_only:
        out["skip_tokenizer_init"] = True
    # A dict (vLLM's, the CLI's JSON) or a StructuredOutputsConfig; ValueError for unknown keys,
    # a backend other than xgrammar, reasoning parsers.
    out["structured_outputs_config"] = StructuredOutputsConfig.from_value(args.structured_outputs_config)
    # vLLM's dict (the CLI's JSON) or a SpeculativeConfig; ValueError naming a method tidal does
    # not implement (only "ngram" is), unknown keys, bad values. {} and None: off.
    spec = SpeculativeConfig.from_value(args.speculative_config)
    if spec is not None:
        out["speculative_config"] = spec
    if args.num_kv_blocks is not None:
        if args.num_gpu_blocks_override not in (None, args.num_kv_blocks):
            raise ValueError(f"num_kv_blocks={args.num_kv_blocks} and num_gpu_blocks_override="
                             f"{args.num_gpu_blocks_override} disagree; pass one of them")
        out["num_kv_blocks"] = args.num_kv_blocks
    sizes = graph_sizes(args)
    if sizes is not None:
        out["cuda_graph_sizes"] = sizes
    return out


def graph_sizes(args: "EngineArgs") -> list[int] | None:
    """The CUDA graph sizes vLLM's three args ask for (None: the default grid). cuda_graph_sizes
    with one value N means vLLM's pattern 1, 2, 4, 8, 16, ..., N; with several, those sizes,
    as cudagraph_capture_sizes; max_cudagraph_capture_size caps whichever applies."""
    legacy = args.cuda_graph_sizes
    if legacy is not None and len(legacy) == 1:
        legacy = [s for s in [1, 2, 4, *range(8, legacy[0] + 1, 8)] if s <= legacy[0]]
    explicit = args.cudagraph_capture_sizes
    if explicit is not None and legacy is not None and sorted(set(explicit)) != sorted(set(legacy)):
        raise ValueError(f"cuda_graph_sizes={args.cuda_graph_sizes} and cudagraph_capture_sizes="
                         f"{explicit} disagree; pass one of them")
    sizes = explicit if explicit is not None else legacy
    cap = args.max_cudagraph_capture_size
    if cap is not None:
        if cap < 1:
            raise ValueError(f"max_cudagraph_capture_size must be >= 1, got {cap}")
        sizes = [s for s in (sizes if sizes is not None else cuda_graph_capture_sizes(cap)) if s <= cap]
    return None if sizes is None else sorted(set(sizes))
