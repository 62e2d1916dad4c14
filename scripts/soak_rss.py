"""Soak: 10,000 requests of varied prompt lengths through one `LLM`; the engine core's RSS must
level off (oneDNN used to keep a GEMM primitive for every new row count it met: ~750 MB).

Requests go in batches of random size (so each step's row count varies as under real load),
prompts of U[1, --max-prompt] random tokens, 1-8 output tokens. The core's RSS is sampled after
every 1,000 requests; the growth per 1,000 requests over the last half is the figure to watch.

    python scripts/soak_rss.py [--requests 10000] [--model DIR] [--no-buckets]
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time

import psutil


def core_process() -> psutil.Process:
    for child in psutil.Process().children(recursive=True):
        if "tidal.core.core_proc" in " ".join(child.cmdline()):
            return child
    raise RuntimeError("no engine-core child process found")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--model", default=None, help="default: tidal's embedded default model")
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-buckets", action="store_true", help="TIDAL_CPU_GEMM_BUCKETS=0 (exact GEMM row counts)")
    args = ap.parse_args()
    if args.no_buckets:
        os.environ["TIDAL_CPU_GEMM_BUCKETS"] = "0"  # the core process inherits it
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    model = args.model
    if model is None:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        model = ensure_default_model()
    llm = LLM(model=model, max_model_len=max(512, args.max_prompt + 16), enable_prefix_caching=False, seed=0)
    vocab = llm.model_config.get_vocab_size()
    core = core_process()
    rng = random.Random(args.seed)
    samples: list[tuple[int, float]] = [(0, core.memory_info().rss / 2**20)]
    done, t0 = 0, time.perf_counter()
    print(f"requests  core RSS (MiB)  elapsed (s)   [{'exact rows' if args.no_buckets else 'bucketed rows'}]")
    print(f"{0:8d}  {samples[0][1]:14.1f}  {0.0:11.1f}", flush=True)
    while done < args.requests:
        n = min(rng.randint(1, 64), args.requests - done)
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(rng.randint(1, args.max_prompt))]}
                   for _ in range(n)]
        params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 8), ignore_eos=True) for _ in range(n)]
        llm.generate(prompts, params, use_tqdm=False)
        before, done = done, done + n
        if done // 1000 > before // 1000 or done == args.requests:
            rss = core.memory_info().rss / 2**20
            samples.append((done, rss))
            print(f"{done:8d}  {rss:14.1f}  {time.perf_counter() - t0:11.1f}", flush=True)
    llm.shutdown()
    half = [s for s in samples if s[0] >= args.requests // 2]
    (n0, r0), (n1, r1) = half[0], half[-1]
    per_1000 = (r1 - r0) / max(n1 - n0, 1) * 1000
    print(f"growth over the last half ({n0} -> {n1} requests): {r1 - r0:+.1f} MiB, {per_1000:+.2f} MiB per 1,000 requests")
    print(f"total growth: {samples[-1][1] - samples[0][1]:+.1f} MiB")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
