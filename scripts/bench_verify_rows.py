"""One attention layer's cost for a batch of short multi-row sequences (a speculative
verification's 1 + k rows), attended by the CPU backend row by row in the paged decode kernel
(AttentionMetadata.short_seqs / paged_rows) or as prefill chunks (a gather and an SDPA call each,
the torch path): what PAGED_ROWS_MAX_QUERY_LEN is set by.

    OMP_NUM_THREADS=1 python scripts/bench_verify_rows.py [--heads 8 --kv-heads 4 --head-dim 64]
        [--contexts 64,256,1024,4096] [--batches 1,8,32] [--query-lens 1,2,3,5,9,13,17,25,33]

Printed per (context, batch): for each query length q, the median time of the kernel path and
of the prefill path (microseconds), and their ratio prefill / kernel (> 1: the kernel wins).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tidal.protocol.sizing import cdiv
from tidal.worker import attention_metadata as am
from tidal.worker.attention_cpu import CpuAttentionBackend
from tidal.worker.attention_metadata import AttentionMetadata


def _time(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--contexts", default="64,256,1024,4096")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--query-lens", default="2,3,5,9,13,17,25,33")
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    h, kvh, d, bs = args.heads, args.kv_heads, args.head_dim, args.block_size
    backend = CpuAttentionBackend()
    scale = d**-0.5
    print(f"threads {torch.get_num_threads()}; heads {h}, kv heads {kvh}, head dim {d}, block {bs}")
    for context in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            cells = []
            for ql in map(int, args.query_lens.split(",")):
                seq_len = context + ql
                per = cdiv(seq_len, bs)
                tables = torch.arange(batch * per, dtype=torch.long).view(batch, per)
                k_cache = torch.randn(batch * per, bs, kvh, d)
                v_cache = torch.randn_like(k_cache)
                n = batch * ql
                q, k, v = torch.randn(n, h, d), torch.randn(n, kvh, d), torch.randn(n, kvh, d)
                qsl = [i * ql for i in range(batch + 1)]
                pos = torch.arange(context, seq_len)
                slots = (tables[:, pos // bs] * bs + pos % bs).reshape(-1)
                lens = [seq_len] * batch

                def step() -> torch.Tensor:
                    meta = AttentionMetadata.build(slots, qsl, lens, tables, bs)  # per step, as a runner does
                    return backend.forward(q, k, v, k_cache, v_cache, meta, scale)

                saved = am.PAGED_ROWS_MAX_QUERY_LEN
                try:
                    am.PAGED_ROWS_MAX_QUERY_LEN = 1 << 30
                    kernel = _time(step, args.repeats)
                    am.PAGED_ROWS_MAX_QUERY_LEN = 0
                    prefill = _time(step, args.repeats)
                finally:
                    am.PAGED_ROWS_MAX_QUERY_LEN = saved
                cells.append(f"q={ql}: {kernel * 1e6:7.0f}/{prefill * 1e6:7.0f} ({prefill / kernel:4.2f}x)")
            print(f"context {context:5d} batch {batch:2d}  kernel/prefill us: " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
