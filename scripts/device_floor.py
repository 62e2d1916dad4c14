"""The physical floor of an offline workload on one device (scripts/device_bench.py): what the
model must read and compute, from its config, over measured bandwidth and FLOP/s (measured
here too: `ceilings`)."""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import numpy as np
import torch


def model_numbers(cfg: dict[str, Any], elt: int) -> dict[str, float]:
    h, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // nh
    ffn = cfg["intermediate_size"]
    per_layer = h * nh * hd + 2 * h * nkv * hd + nh * hd * h + 3 * h * ffn
    matmul = layers * per_layer  # per token, LM head apart
    lm_head = vocab * h
    params = matmul + lm_head + (0 if cfg.get("tie_word_embeddings") else vocab * h)
    return {"matmul_params": matmul, "lm_head_params": lm_head, "params": params,
            "weight_bytes_per_step": (matmul + lm_head) * elt,  # the embedding rows looked up: negligible
            "kv_bytes_per_token": 2 * layers * nkv * hd * elt,
            "attn_flops_per_pair": 4 * layers * nh * hd}  # QK^T + PV, per (query, key) pair


def m_kv_block(cfg: dict[str, Any], block_size: int, dtype: torch.dtype) -> int:
    return block_size * model_numbers(cfg, torch.empty((), dtype=dtype).element_size())["kv_bytes_per_token"]


def floor_model(prompts: list[int], outputs: list[int], m: dict[str, float], bw: float, rate: float) -> dict[str, Any]:
    p, o = np.array(prompts, dtype=np.float64), np.array(outputs, dtype=np.float64)
    prefill_flops = (2 * m["matmul_params"] * p.sum() + 2 * m["lm_head_params"] * len(p)
                     + m["attn_flops_per_pair"] * (p * (p + 1) / 2).sum())
    steps = int(o.max()) - 1
    decode_bytes = decode_flops = roof = 0.0
    for t in range(1, steps + 1):
        live = o > t
        n, ctx = int(live.sum()), float((p[live] + t).sum())
        b = m["weight_bytes_per_step"] + m["kv_bytes_per_token"] * ctx
        f = 2 * (m["matmul_params"] + m["lm_head_params"]) * n + m["attn_flops_per_pair"] * ctx
        decode_bytes += b
        decode_flops += f
        roof += max(b / bw, f / rate)
    floor_s = decode_bytes / bw + prefill_flops / rate
    floor_s = float(floor_s)
    return {"floor_s": floor_s, "floor_roofline_s": roof + prefill_flops / rate,
            "decode_steps": steps, "decode_bytes": decode_bytes, "decode_flops": decode_flops,
            "prefill_flops": prefill_flops, "decode_floor_s": decode_bytes / bw,
            "prefill_floor_s": prefill_flops / rate, "floor_output_tok_s": float(o.sum()) / floor_s}


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_fn(fn: Callable[[], Any], dev: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of fn (CUDA events on the GPU, perf_counter after a sync elsewhere)."""
    for _ in range(warmup):
        fn()
    sync(dev)
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def ceilings(dev: torch.device, copy_mb: int, n: int, dtype: torch.dtype) -> dict[str, float]:
    src = torch.empty(copy_mb << 19, dtype=torch.bfloat16, device=dev).normal_()  # copy_mb MiB, random
    dst = torch.empty_like(src)
    t_copy = time_fn(lambda: dst.copy_(src), dev, 20, 3)
    nbytes = src.numel() * src.element_size()
    a = torch.randn(n, n, dtype=dtype, device=dev)
    b = torch.randn(n, n, dtype=dtype, device=dev)
    t_mm = time_fn(lambda: a @ b, dev, 20 if dev.type == "cuda" else 3, 3)
    return {"copy_bytes": nbytes, "copy_s": t_copy, "bandwidth_Bps": 2 * nbytes / t_copy,
            "matmul_n": n, "matmul_s": t_mm, "matmul_flops": 2 * n**3 / t_mm}
