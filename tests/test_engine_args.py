"""EngineArgs / AsyncEngineArgs (vLLM's names and defaults): each arg's outcome (implemented,
no-op with one warning, refused by name), typos, and the CLI generated from the fields."""
from __future__ import annotations

import argparse
import logging
from dataclasses import fields
from typing import Any

import pytest

from tidal.frontend import AsyncEngineArgs, EngineArgs
from tidal.frontend.arg_cli import human_readable_int
from tidal.frontend.arg_rules import RULES, Implemented, NoOp, Refused, field_default

TIDAL_EXTRAS = {"device", "worker_step_timeout_s", "engine_start_timeout_s", "heartbeat_timeout_s",
                "core_address", "model_runner", "num_kv_blocks", "max_core_restarts",
                "core_reconnect_timeout_s", "core_key_file", "max_waiting_requests", "grammar_compile_timeout_s",
                "engine_core_addresses"}


def test_every_vllm_arg_is_a_field_with_exactly_one_outcome() -> None:
    names = [f.name for f in fields(AsyncEngineArgs)]
    assert len(names) == len(set(names)) == 151 + len(TIDAL_EXTRAS)  # vLLM 0.12's 151 + tidal's
    assert set(names) == set(RULES)
    assert all(isinstance(r, (Implemented, NoOp, Refused)) for r in RULES.values())


def test_vllm_defaults() -> None:
    args = EngineArgs()
    assert args.model == "Qwen/Qwen3-0.6B" and args.seed == 0 and args.max_logprobs == 20
    assert (args.swap_space, args.gpu_memory_utilization, args.block_size, args.max_num_seqs) == (4, 0.9, None, None)
    assert (args.scheduling_policy, args.logprobs_mode, args.tokenizer_mode) == ("fcfs", "raw_logprobs", "auto")
    assert args.ignore_patterns == ["original/**/*"] and args.disable_log_stats is False
    assert AsyncEngineArgs().enable_log_requests is False


def test_implemented_args_reach_the_engine_config() -> None:
    cfg = EngineArgs(model="/m", max_num_seqs=8, max_num_batched_tokens=512, num_gpu_blocks_override=99,
                     enable_prefix_caching=False, enable_chunked_prefill=False, dtype="half", seed=7,
                     enforce_eager=True, kv_cache_dtype="float16", tokenizer_mode="slow", revision="r1",
                     tokenizer_revision="t1", scheduling_policy="priority", logprobs_mode="raw_logits",
                     max_logprobs=-1, disable_log_stats=True, served_model_name="svc", block_size=32,
                     tensor_parallel_size=2, skip_tokenizer_init=True).create_engine_config()
    assert (cfg.model, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.num_kv_blocks) == ("/m", 8, 512, 99)
    assert (cfg.enable_prefix_caching, cfg.enable_chunked_prefill, cfg.dtype, cfg.seed) == (False, False, "float16", 7)
    assert (cfg.enforce_eager, cfg.kv_cache_dtype, cfg.tokenizer_mode) == (True, "float16", "slow")
    assert (cfg.revision, cfg.tokenizer_revision, cfg.scheduling_policy) == ("r1", "t1", "priority")
    assert (cfg.logprobs_mode, cfg.max_logprobs, cfg.disable_log_stats) == ("raw_logits", -1, True)
    assert (cfg.served_model_name, cfg.block_size, cfg.tensor_parallel_size) == ("svc", 32, 2)
    assert cfg.skip_tokenizer_init


def test_late_defaults_resolve_as_vllm() -> None:
    cfg = EngineArgs(model="/m", seed=None).create_engine_config()
    assert cfg.seed == 0 and cfg.enable_prefix_caching and cfg.enable_chunked_prefill
    assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == (256, 2048, 16)
    assert EngineArgs(model="/m", tokens_only=True).create_engine_config().skip_tokenizer_init
    assert EngineArgs(model="/m", num_kv_blocks=5).create_engine_config().num_kv_blocks == 5
    with pytest.raises(ValueError, match="disagree"):
        EngineArgs(model="/m", num_kv_blocks=5, num_gpu_blocks_override=6).create_engine_config()


@pytest.mark.parametrize("name, value", [
    ("compilation_config", {"level": 3}), ("compilation_config", 3), ("runner", "generate"),
    ("swap_space", 8), ("disable_custom_all_reduce", True), ("async_scheduling", True),
    ("enable_sleep_mode", True), ("max_parallel_loading_workers", 2), ("use_tqdm_on_load", False),
    ("optimization_level", 0),
    ("hf_token", "hf_x"), ("download_dir", "/tmp/d"),
])
def test_noop_args_warn_once(name: str, value: Any, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tidal.engine_args"):
        cfg = EngineArgs(model="/m", **{name: value}).create_engine_config()
    named = [r for r in caplog.records if name in r.getMessage()]
    assert len(named) == 1 and "no effect in tidal" in named[0].getMessage()
    assert cfg == EngineArgs(model="/m").create_engine_config()  # and nothing changed


@pytest.mark.parametrize("kwargs, want", [
    ({}, None),
    ({"cudagraph_capture_sizes": [8, 1, 2]}, [1, 2, 8]),
    ({"cuda_graph_sizes": [4, 16]}, [4, 16]),
    ({"cuda_graph_sizes": [24]}, [1, 2, 4, 8, 16, 24]),  # one value: vLLM's pattern up to it
    ({"cuda_graph_sizes": [3]}, [1, 2]),
    ({"max_cudagraph_capture_size": 20}, [1, 2, 4, 8, 16, 20]),
    ({"cudagraph_capture_sizes": [1, 8, 64], "max_cudagraph_capture_size": 32}, [1, 8]),
    ({"cuda_graph_sizes": [8], "cudagraph_capture_sizes": [1, 2, 4, 8]}, [1, 2, 4, 8]),  # agree
])
def test_cuda_graph_sizes_resolve(kwargs: dict[str, Any], want: list[int] | None) -> None:
    assert EngineArgs(model="/m", **kwargs).create_engine_config().cuda_graph_sizes == want


def test_cuda_graph_sizes_refused() -> None:
    with pytest.raises(ValueError, match="disagree"):
        EngineArgs(model="/m", cuda_graph_sizes=[16], cudagraph_capture_sizes=[1, 2]).create_engine_config()
    with pytest.raises(ValueError, match="max_cudagraph_capture_size must be >= 1"):
        EngineArgs(model="/m", max_cudagraph_capture_size=0).create_engine_config()
    with pytest.raises(ValueError, match="cuda_graph_sizes must be batch sizes >= 1"):
        EngineArgs(model="/m", cudagraph_capture_sizes=[0, 4]).create_engine_config()


def test_defaults_and_their_none_forms_are_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tidal.engine_args"):
        EngineArgs(model="/m", compilation_config=None, hf_overrides={}, runner="auto", convert="auto",
                   swap_space=4, cpu_offload_gb=0, lora_dtype="auto").create_engine_config()
    assert not caplog.records


@pytest.mark.parametrize("name, value, feature", [
    ("speculative_config", {"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
    ("enable_lora", True, "LoRA"), ("max_loras", 4, "LoRA"), ("quantization", "awq", "quantized"),
    ("pipeline_parallel_size", 2, "pipeline parallelism"), ("data_parallel_hybrid_lb", True, "hybrid load balancing"),
    ("limit_mm_per_prompt", {"image": 1}, "multimodal"), ("kv_transfer_config", {"kv_connector": "x"}, "KV transfer"),
    ("runner", "pooling", "pooling"), ("enable_prompt_embeds", True, "prompt embeddings"),
    ("tokenizer_mode", "mistral", "mistral"), ("kv_cache_dtype", "fp8", "fp8"),
    ("cpu_offload_gb", 4, "offloading weights"), ("distributed_executor_backend", "external_launcher", "external_launcher"),
    ("load_format", "pt", "weight formats"),
])
def test_refused_args_name_the_feature(name: str, value: Any, feature: str) -> None:
    with pytest.raises(ValueError, match=feature) as info:
        EngineArgs(model="/m", **{name: value}).create_engine_config()
    assert name in str(info.value)


def test_typo_suggests_the_closest_name() -> None:
    with pytest.raises(TypeError, match="did you mean 'enforce_eager'"):
        EngineArgs(model="/m", enforce_eagr=True)
    with pytest.raises(TypeError, match="did you mean 'enable_log_requests'"):
        AsyncEngineArgs(model="/m", enable_log_request=True)
    with pytest.raises(TypeError, match="no_such_arg"):
        EngineArgs(no_such_arg=1)


def _argv(values: dict[str, Any]) -> list[str]:
    """vLLM-style argv for these field values (written independently of arg_cli)."""
    argv: list[str] = []
    for name, v in values.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(v, bool):
            argv.append(flag if v else "--no-" + flag[2:])
        elif isinstance(v, list):
            argv += [flag, *map(str, v)]
        elif isinstance(v, dict):
            import json

            argv += [flag, json.dumps(v)]
        else:
            argv += [flag, str(v)]
    return argv


def test_cli_round_trip() -> None:
    values: dict[str, Any] = dict(
        model="/m", tokenizer="/t", max_model_len=512, max_num_seqs=8, seed=3, enforce_eager=True,
        enable_prefix_caching=False, gpu_memory_utilization=0.5, compilation_config={"mode": 0},
        cudagraph_capture_sizes=[1, 2, 4], tokenizer_mode="slow", kv_cache_dtype="auto", device="cpu",
        num_kv_blocks=64, scheduling_policy="priority", trust_remote_code=True, engine_start_timeout_s=30.0)
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = EngineArgs.from_cli_args(parser.parse_args(_argv(values)))
    assert args == EngineArgs(**values)
    assert EngineArgs.from_cli_args(parser.parse_args([])) == EngineArgs()  # absent flags: defaults


def test_cli_spellings() -> None:
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["-tp", "2", "--max-model-len", "1K", "--disable-log-stats", "--hf-token",
                            "--seed", "None", "-cc", "3", "--enable-log-requests", "--num-gpu-blocks-override", "9"])
    args = AsyncEngineArgs.from_cli_args(ns)
    assert (args.tensor_parallel_size, args.max_model_len, args.disable_log_stats) == (2, 1024, True)
    assert (args.hf_token, args.seed, args.compilation_config, args.enable_log_requests) == (True, None, 3, True)
    assert args.num_gpu_blocks_override == 9
    with pytest.raises(SystemExit):  # store_true, as vLLM: there is no --no-disable-log-stats
        parser.parse_args(["--no-disable-log-stats"])
    only = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser(), async_args_only=True)
    assert only.parse_args(["--enable-log-requests"]).enable_log_requests
    with pytest.raises(SystemExit):
        only.parse_args(["-tp", "2"])


def test_human_readable_int() -> None:
    assert [human_readable_int(v) for v in ("7", "1k", "1K", "25.6k", "2M", "2G")] == [
        7, 1000, 1024, 25600, 2 * 1024**2, 2 * 1024**3]


def test_field_defaults_match_the_dataclass() -> None:
    fresh = EngineArgs()
    for f in fields(EngineArgs):
        assert field_default(f) == getattr(fresh, f.name)


def test_dtype_torch_dtype_and_names() -> None:
    torch = pytest.importorskip("torch")
    for dtype, name in [(torch.bfloat16, "bfloat16"), (torch.half, "float16"), (torch.float, "float32"),
                        ("half", "float16"), ("float", "float32"), ("auto", "auto")]:
        cfg = EngineArgs(model="/m", dtype=dtype).create_engine_config()
        assert cfg.dtype == name
        assert type(cfg).from_json(cfg.to_json()).dtype == name  # the config travels as JSON
    for bad in ("bf16", torch.int8, 16):
        with pytest.raises(ValueError, match="use one of auto, half, float16, bfloat16, float, float32"):
            EngineArgs(model="/m", dtype=bad).create_engine_config()
