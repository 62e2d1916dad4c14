"""The `tidal` command line: generate (default model and --model), make-model, engine flags."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from tidal.frontend.entrypoints.cli import build_parser
from tidal.frontend.engine_args import config_from_args


def tidal(args: list[str], cache_dir: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, TIDAL_CACHE_DIR=cache_dir)
    return subprocess.run([sys.executable, "-m", "tidal.frontend.entrypoints.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def test_generate_with_default_model(tidal_cache_dir: str) -> None:
    res = tidal(["generate", "--max-tokens", "12", "--seed", "1", "--ignore-eos", "--num-kv-blocks", "64",
                 "--max-model-len", "256"], tidal_cache_dir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip(), "no text streamed"
    assert "random" in res.stderr and "gibberish" in res.stderr
    assert os.path.isfile(os.path.join(tidal_cache_dir, "default-model", "config.json"))


def test_make_model_writes_a_loadable_dir(tmp_path: Any, tidal_cache_dir: str) -> None:
    out = str(tmp_path / "llama-mini")
    res = tidal(["make-model", out, "--arch", "llama", "--hidden-size", "32", "--num-layers", "1",
                 "--num-heads", "2", "--num-kv-heads", "1", "--vocab-size", "512"], tidal_cache_dir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == os.path.abspath(out)
    with open(os.path.join(out, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["hidden_size"] == 32
    res = tidal(["generate", "--model", out, "--prompt", "def main():", "--max-tokens", "6",
                 "--temperature", "0", "--ignore-eos", "--num-kv-blocks", "32", "--max-model-len", "128"],
                tidal_cache_dir)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() and "gibberish" not in res.stderr


def test_generate_reports_bad_model_dir(tmp_path: Any, tidal_cache_dir: str) -> None:
    res = tidal(["generate", "--model", str(tmp_path / "missing"), "--max-tokens", "2"], tidal_cache_dir)
    assert res.returncode == 1 and "tidal generate: error:" in res.stderr


def test_engine_flags_map_to_config() -> None:
    args = build_parser().parse_args([
        "core", "/m", "--address", "tcp://127.0.0.1:7000", "--dtype", "bfloat16", "--max-model-len", "512",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "1024", "--block-size", "32", "--seed", "5",
        "--load-format", "dummy", "-tp", "2", "--num-gpu-blocks-override", "99",
        "--kv-cache-memory-bytes", "1000000", "--no-enable-prefix-caching", "--enable-chunked-prefill",
        "--max-logprobs", "3", "--tokenizer", "/t", "--device", "cpu",
    ])
    cfg = config_from_args(args, model=args.model)
    assert (cfg.model, cfg.dtype, cfg.max_model_len, cfg.max_num_seqs, cfg.max_num_batched_tokens) == (
        "/m", "bfloat16", 512, 8, 1024)
    assert (cfg.block_size, cfg.seed, cfg.load_format, cfg.tensor_parallel_size, cfg.num_kv_blocks) == (
        32, 5, "dummy", 2, 99)
    assert (cfg.kv_cache_memory_bytes, cfg.enable_prefix_caching, cfg.enable_chunked_prefill) == (
        1_000_000, False, True)
    assert (cfg.max_logprobs, cfg.tokenizer, cfg.device) == (3, "/t", "cpu")
    # Flags not given keep EngineConfig's defaults.
    default = config_from_args(build_parser().parse_args(["generate"]), model="/m")
    assert default.max_num_seqs == 256 and default.enable_prefix_caching and default.seed == 0
    gen = build_parser().parse_args(["generate", "--seed", "9", "--tensor-parallel-size", "1"])
    assert gen.seed == 9 and config_from_args(gen, model="/m").tensor_parallel_size == 1
