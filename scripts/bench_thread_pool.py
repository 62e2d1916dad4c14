"""The kernels' thread team against OpenMP regions on a batch-1 decode step's GEMVs, one run.

A "step" is the benchmark model's linear layers at one row, layer after layer (QKV, O, gate-up,
down for each of 6 layers, then the LM head), with the Python between the calls a real step
has. Steps alternate between the team (TIDAL_CPU_THREAD_POOL=1) and OpenMP regions (=0) in
the same process; the medians and their ratio are printed. Run it on a quiet machine for the
kernels alone, or beside a load (--load N busy processes) for what it is for: a thread the OS
does not run at once costs the OpenMP region's closing barrier, not the team's caller.

    python scripts/bench_thread_pool.py [--dtype bfloat16] [--steps 200] [--load 0]
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

from tidal.utils.openmp import prefer_compute_process_env

prefer_compute_process_env()  # the OpenMP wait tidal's workers run with (before torch loads libgomp)

import torch  # noqa: E402

from tidal.worker import cpu_kernels as ck  # noqa: E402
from tidal.worker import panel_gemm as hg  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 512, 1536, 6, 8192, 8, 4, 64


def _spin() -> None:
    while True:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--load", type=int, default=0, help="busy processes beside the benchmark")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    lib = ck.cpu_kernels()
    assert lib is not None, "no C compiler: kernels unavailable"
    shapes = [((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN), (HIDDEN, HEADS * HEAD_DIM), (2 * INTER, HIDDEN),
              (HIDDEN, INTER)] * LAYERS + [(VOCAB, HIDDEN)]
    weights = [(hg.pack_weight(torch.randn(n, k), dtype), n, k) for n, k in shapes]
    x = {k: torch.randn(1, k) for k in {k for _, k in shapes}}
    load = [mp.Process(target=_spin, daemon=True) for _ in range(args.load)]
    for p in load:
        p.start()
    times: dict[int, list[float]] = {0: [], 1: []}
    try:
        for step in range(2 * args.steps + 20):
            pool = (step // 10) % 2  # blocks of 10: the other runtime's threads are asleep by then
            lib.tidal_set_thread_pool(pool)
            t0 = time.perf_counter()
            for packed, n, k in weights:
                hg.panel_linear(x[k], packed, n, k, None)
            if step >= 20 and step % 10 >= 2:  # warm-up steps, and each block's first two, are not counted
                times[pool].append(time.perf_counter() - t0)
    finally:
        lib.tidal_set_thread_pool(1)
        for p in load:
            p.kill()
            p.join()
    omp, team = statistics.median(times[0]), statistics.median(times[1])
    weight_mb = sum(p.numel() * p.element_size() for p, _, _ in weights) / 1e6
    print(f"{args.dtype}, {len(weights)} GEMVs a step ({weight_mb:.1f} MB of weights), {torch.get_num_threads()} "
          f"threads, {args.load} busy processes beside")
    print(f"OpenMP regions: {omp * 1e3:.3f} ms a step ({weight_mb / 1e3 / omp:.1f} GB/s)")
    print(f"thread team:    {team * 1e3:.3f} ms a step ({weight_mb / 1e3 / team:.1f} GB/s)")
    print(f"team / OpenMP speed: {omp / team:.2f}x")


if __name__ == "__main__":
    main()
