"""CPU fast paths vs the torch ops they replace, in one run: time per call and the ratio.

  - linear: oneDNN with the weight packed once (layers/gemm.py) vs F.linear (MKL), per row count,
    with six layers' weights cycled so they come from DRAM as in a real decode step;
  - decode attention: the C kernel reading the paged cache (attention_cpu.py) vs the torch
    backend (gather each sequence's blocks, then SDPA), per batch size, over a pool larger than
    the caches;
  - RMSNorm (+ residual), qk-norm + RoPE, SiLU-and-mul: C kernels vs the torch ops;
  - panel GEMM (float32 / fp16 / bf16 weights, panel_gemm.py) vs oneDNN float32 packed, per shape and row
    count, each over enough copies of the weight (>= 96 MB in float32) that it comes from DRAM;
    median of 3 interleaved measurements;
  - decode attention over fp16 / bf16 caches vs the float32 cache (the same C kernel).

Shapes are the bench_offline model's (hidden 512, 8 heads / 4 kv heads of 64, MLP 1536).

    python scripts/bench_cpu_kernels.py
"""
from __future__ import annotations

import os
import random
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tidal.protocol.sizing import cdiv
from tidal.worker.attention_cpu import CpuAttentionBackend
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.attention_torch import TorchAttentionBackend
from tidal.worker.cpu_kernels import cpu_kernels
from tidal.worker.layers.activation import SiluAndMul
from tidal.worker.layers.gemm import PackedWeight
from tidal.worker.layers.layernorm import RMSNorm
from tidal.worker.layers.qk_norm_rope import QKNormRope
from tidal.worker.layers.rotary import RotaryEmbedding
from tidal.worker.loader import tune_cpu_malloc
from tidal.worker.panel_gemm import pack_weight, panel_linear

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, MLP = 512, 8, 4, 64, 1536


def timed(fn: Callable[[], object], min_s: float = 0.3) -> float:
    """Seconds per call: two warm-up calls, then repeat until min_s has passed."""
    fn()
    fn()
    n, start = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_s:
            return elapsed / n


def row(name: str, ours: float, ref: float) -> None:
    print(f"  {name:34s} tidal {ours * 1e6:9.1f} us   torch {ref * 1e6:9.1f} us   ratio {ref / ours:5.2f}x")


def bench_linear() -> None:
    print("linear (6 layers' qkv/o/gate_up/down per call; weights from DRAM):")
    shapes = [(1024, HIDDEN), (HIDDEN, HIDDEN), (2 * MLP, HIDDEN), (HIDDEN, MLP)]
    dense = [[torch.randn(n, k) for n, k in shapes] for _ in range(6)]
    packed = [[PackedWeight(w) for w in layer] for layer in dense]
    for m in (1, 4, 16, 32, 256, 2048):
        xs = {k: torch.randn(m, k) for k in (HIDDEN, MLP)}
        ours = timed(lambda: [p.linear(xs[p.shape[1]]) for layer in packed for p in layer])
        ref = timed(lambda: [F.linear(xs[w.shape[1]], w) for layer in dense for w in layer])
        row(f"{m} rows", ours, ref)


def _decode_tables(rng: random.Random, batch: int, block: int, ids: list[int]) -> tuple[list[int], torch.Tensor]:
    """Context lengths U[17, 384] for `batch` decodes and block tables drawn from shuffled `ids`."""
    lens = [rng.randint(17, 384) for _ in range(batch)]
    rng.shuffle(ids)
    need = [cdiv(n, block) for n in lens]
    tables = torch.zeros(batch, max(need), dtype=torch.long)
    offset = 0
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[offset: offset + n])
        offset += n
    return lens, tables


DECODE_BLOCK, DECODE_POOL = 16, 4096  # block size and pool of the decode-attention benches


def _decode_pool() -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Random float32 K and V caches of DECODE_POOL blocks, and the block ids to draw from."""
    shape = (DECODE_POOL, DECODE_BLOCK, KV_HEADS, HEAD_DIM)
    return torch.randn(shape), torch.randn(shape), list(range(DECODE_POOL))


def bench_decode_attention() -> None:
    print("decode attention (one layer; contexts U[17,384], pool of 4096 blocks of 16):")
    rng = random.Random(0)
    block = DECODE_BLOCK
    k_cache, v_cache, ids = _decode_pool()
    for batch in (1, 4, 16, 32, 64):
        lens, tables = _decode_tables(rng, batch, block, ids)
        slots = torch.tensor([int(tables[i, (n - 1) // block]) * block + (n - 1) % block for i, n in enumerate(lens)])
        meta = AttentionMetadata.build(slots, list(range(batch + 1)), lens, tables, block)
        q = torch.randn(batch, HEADS, HEAD_DIM)
        k, v = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)
        cpu, ref_backend = CpuAttentionBackend(), TorchAttentionBackend()
        got = cpu.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
        want = ref_backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5)
        assert torch.allclose(got, want, atol=1e-4), "kernel and torch backend disagree"
        ours = timed(lambda: cpu.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5))
        ref = timed(lambda: ref_backend.forward(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5))
        row(f"{batch} sequences", ours, ref)


def _median_times(fns: list[Callable[[], object]], repeats: int = 3, min_s: float = 0.1) -> list[float]:
    """Median seconds per call of each fn, measured in turns so drifting load hits all alike."""
    runs = [[timed(fn, min_s) for fn in fns] for _ in range(repeats)]
    return [sorted(r[i] for r in runs)[repeats // 2] for i in range(len(fns))]


def bench_panel_gemm(rows: tuple[int, ...] = (1, 4, 8, 16, 32, 64, 256)) -> None:
    print("panel GEMM (f32 / fp16 / bf16 weights) vs oneDNN float32 packed (per call; weights cycled from DRAM;"
          " ratio = oneDNN / panel):")
    shapes = {"qkv": (1024, HIDDEN), "o_proj": (HIDDEN, HIDDEN), "gate_up": (2 * MLP, HIDDEN),
              "down": (HIDDEN, MLP), "lm_head": (8192, HIDDEN)}
    for name, (n, k) in shapes.items():
        copies = max(2, cdiv(96 << 20, n * k * 4))
        dense = [torch.randn(n, k) * 0.05 for _ in range(copies)]
        onednn = [PackedWeight(w) for w in dense]
        pools = {dt: [pack_weight(w, dt) for w in dense] for dt in (torch.float32, torch.float16, torch.bfloat16)}
        for m in rows:
            x = torch.randn(m, k)
            it = {"onednn": 0, torch.float32: 0, torch.float16: 0, torch.bfloat16: 0}

            def step(kind: object, pool: list, call: Callable[[object], object]) -> None:
                it[kind] = (it[kind] + 1) % len(pool)
                call(pool[it[kind]])

            def panel(dt: torch.dtype) -> Callable[[], None]:
                return lambda: step(dt, pools[dt], lambda p: panel_linear(x, p, n, k))

            ref, *ours = _median_times([lambda: step("onednn", onednn, lambda p: p.linear(x)),
                                        *(panel(dt) for dt in pools)])
            gflops = 2 * m * n * k / 1e9
            cells = "".join(f"  {label} {t * 1e6:8.1f} us ({gflops / t:4.0f}) {ref / t:5.2f}x"
                            for label, t in zip(("f32", "fp16", "bf16"), ours))
            print(f"  {name:8s} N={n:5d} K={k:5d} M={m:4d}  oneDNN {ref * 1e6:8.1f} us ({gflops / ref:4.0f} GF/s){cells}")


def bench_half_cache_attention() -> None:
    print("decode attention over half caches vs the float32 cache (C kernel; ratio = f32 / half):")
    rng = random.Random(0)
    block = DECODE_BLOCK
    k32, v32, ids = _decode_pool()
    caches = {dt: (k32.to(dt), v32.to(dt)) for dt in (torch.float16, torch.bfloat16)}
    caches[torch.float32] = (k32, v32)
    cpu = CpuAttentionBackend()
    for batch in (1, 4, 16, 32, 64):
        lens, tables = _decode_tables(rng, batch, block, ids)
        meta = AttentionMetadata.build(torch.full((batch,), -1), list(range(batch + 1)), lens, tables, block)
        q = torch.randn(batch, HEADS, HEAD_DIM)
        k, v = torch.randn(batch, KV_HEADS, HEAD_DIM), torch.randn(batch, KV_HEADS, HEAD_DIM)

        def run(dt: torch.dtype) -> Callable[[], object]:
            kc, vc = caches[dt]
            return lambda: cpu.forward(q, k, v, kc, vc, meta, HEAD_DIM**-0.5)

        t32, t16, tb16 = _median_times([run(torch.float32), run(torch.float16), run(torch.bfloat16)])
        print(f"  {batch:3d} sequences   f32 {t32 * 1e6:8.1f} us   fp16 {t16 * 1e6:8.1f} us {t32 / t16:5.2f}x"
              f"   bf16 {tb16 * 1e6:8.1f} us {t32 / tb16:5.2f}x")


def bench_elementwise() -> None:
    print("elementwise (C kernel vs the torch ops of the same layer):")
    norm = RMSNorm(HIDDEN)
    act = SiluAndMul()
    rope = RotaryEmbedding(HEAD_DIM, HEAD_DIM, 4096, 1e6)
    qk_norm_rope = QKNormRope(rope, HEADS, KV_HEADS, 1e-6)
    head_norm = qk_norm_rope.q_norm
    assert head_norm is not None
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    for tokens in (32, 4096):
        x, res = torch.randn(tokens, HIDDEN), torch.randn(tokens, HIDDEN)
        gate_up = torch.randn(tokens, 2 * MLP)
        qkv, pos = torch.randn(tokens, width), torch.randint(0, 4096, (tokens,))
        row(f"add + RMSNorm, {tokens} tokens", timed(lambda: norm(x.clone(), res.clone())),
            timed(lambda: norm._norm(x.clone() + res.clone())))
        row(f"SiLU and mul, {tokens} tokens", timed(lambda: act(gate_up)),
            timed(lambda: F.silu(gate_up[:, :MLP]) * gate_up[:, MLP:]))

        def torch_qk_rope() -> None:
            q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            qn = head_norm._norm(q.reshape(tokens, HEADS, HEAD_DIM))  # RMSNorm's torch ops
            kn = head_norm._norm(k.reshape(tokens, KV_HEADS, HEAD_DIM))
            rope(pos, qn, kn)

        row(f"qk-norm + RoPE, {tokens} tokens",
            timed(lambda: qk_norm_rope(pos, qkv)), timed(torch_qk_rope))


def main() -> None:
    tune_cpu_malloc()  # as the engine does: freed activations stay in the heap
    torch.manual_seed(0)
    if cpu_kernels() is None:
        raise SystemExit("the C kernels could not be built here (no C compiler?)")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    with torch.inference_mode():
        bench_linear()
        bench_decode_attention()
        bench_elementwise()
        bench_panel_gemm()
        bench_half_cache_attention()


if __name__ == "__main__":
    main()
