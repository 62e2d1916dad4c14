"""Soak: many short requests through one engine; does memory level off? (issue 12, "Done when")

    python scripts/soak.py [--requests 20000] [--no-prefix-caching] [--batch 200] [--max-tokens 8]
                           [--model DIR] [--inproc [--tracemalloc]]

Sends `--requests` short requests through one `LLM` (the embedded tiny default model unless
--model), `--batch` per `generate()` call, and prints the engine core's and this front-end's
RSS (psutil) after every 1,000 requests; at the end the growth per 1,000 requests over the last
half (least-squares slope of the samples there), for both processes.

Prompts are token ids: random lengths, a quarter sharing one of a few prefixes (so prefix
caching caches, hits and evicts), max_tokens short, greedy and seeded sampling mixed.

--inproc runs the core in this process (LLM(multiprocessing=False)); it then also prints the
sizes of the engine's per-request and cache structures and how many distinct KV blocks were
ever handed out (the KV cache tensors are zero-filled lazily, so every block touched for the
first time adds its pages to the RSS: with the real model, RSS growth is mostly that), and
with --tracemalloc the Python allocations that grew most over the last half, by line.
"""
from __future__ import annotations

import argparse
import gc
import random
import time
import tracemalloc
from typing import Any

import psutil

REPORT_EVERY = 1000


def _core_process(parent: psutil.Process | None = None) -> psutil.Process | None:
    """The engine-core process among `parent`'s descendants (default: this process's)."""
    for p in (parent or psutil.Process()).children(recursive=True):
        try:
            if "tidal.core.core_proc" in " ".join(p.cmdline()):
                return p
        except psutil.NoSuchProcess:
            pass
    return None


def _rss_mb(p: psutil.Process | None) -> float:
    if p is None:
        return float("nan")
    try:
        return p.memory_info().rss / 2**20
    except psutil.NoSuchProcess:
        return float("nan")


def _slope_per_1000(points: list[tuple[int, float]]) -> float:
    """Least-squares slope of (requests, MB) in MB per 1,000 requests."""
    n = len(points)
    if n < 2:
        return float("nan")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    sxy = sum((x - mx) * (y - my) for x, y in points)
    return 1000 * sxy / sxx


def _prompts(rng: random.Random, n: int, vocab: int) -> list[dict[str, list[int]]]:
    prefixes = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(4)]
    out = []
    for _ in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))]
        if rng.random() < 0.25:
            body = prefixes[rng.randrange(len(prefixes))] + body
        out.append({"prompt_token_ids": body})
    return out


def _structure_sizes(llm: Any) -> dict[str, int]:
    """Sizes of the in-process engine's per-request and cache structures (--inproc only)."""
    core = llm.engine_core.engine  # InprocClient's EngineCore
    sched, sizes = core.scheduler, {}
    for owner, obj in (("scheduler", sched), ("kv", sched.kv_cache_manager),
                       ("block_pool", sched.kv_cache_manager.block_pool)):
        for name, value in vars(obj).items():
            if isinstance(value, (dict, list, set)):
                sizes[f"{owner}.{name}"] = len(value)
    worker = getattr(core.executor, "worker", None)
    runner = getattr(worker, "model_runner", None) or getattr(core.executor, "model_runner", None)
    if runner is not None:
        sizes["runner.requests"] = len(runner.requests)
    sizes["output_processor.request_states"] = len(llm.output_processor.request_states)
    return sizes


def _record_blocks(used: set[int]) -> None:
    """Record the id of every KV block the block pool hands out (this process's engine)."""
    from tidal.core.block_pool import BlockPool

    get_new_blocks = BlockPool.get_new_blocks

    def recording(self: BlockPool, num_blocks: int) -> list[Any]:
        blocks = get_new_blocks(self, num_blocks)
        used.update(b.block_id for b in blocks)
        return blocks

    BlockPool.get_new_blocks = recording  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--batch", type=int, default=200, help="requests per generate() call")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--model", default=None, help="HF model dir (default: the embedded tiny model)")
    ap.add_argument("--model-runner", default="torch", choices=["torch", "null"])
    ap.add_argument("--inproc", action="store_true", help="run the engine core in this process")
    ap.add_argument("--tracemalloc", action="store_true", help="with --inproc: top Python growth")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.tracemalloc and not args.inproc:
        ap.error("--tracemalloc needs --inproc (it sees this process only)")
    blocks_used: set[int] = set()
    if args.inproc:
        _record_blocks(blocks_used)

    from tidal.frontend import LLM
    from tidal.frontend.entrypoints.make_model import ensure_default_model
    from tidal.protocol import SamplingParams

    model = args.model or ensure_default_model()
    llm = LLM(model=model, enable_prefix_caching=not args.no_prefix_caching, model_runner=args.model_runner,
              multiprocessing=not args.inproc, seed=args.seed)
    vocab = llm.info.vocab_size
    core = None if args.inproc else _core_process()
    me = psutil.Process()
    rng = random.Random(args.seed)
    params = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.9, ignore_eos=True)]
    print(f"soak: {args.requests} requests, prefix caching {'off' if args.no_prefix_caching else 'on'}, "
          f"model {model}, core {'in this process' if args.inproc else core.pid if core else '?'}", flush=True)
    print(f"{'requests':>9} {'core MB':>9} {'front MB':>9} {'s':>7}", flush=True)
    samples: list[tuple[int, float, float]] = []
    snap_half = None
    done, t0 = 0, time.perf_counter()
    try:
        while done < args.requests:
            n = min(args.batch, args.requests - done)
            prompts = _prompts(rng, n, vocab)
            outs = llm.generate(prompts, [params[i % 2] for i in range(n)], use_tqdm=False)
            assert len(outs) == n and all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
            del outs
            done += n
            if done % REPORT_EVERY == 0 or done == args.requests:
                gc.collect()
                core_mb = _rss_mb(me) if args.inproc else _rss_mb(core)
                front_mb = _rss_mb(me)
                samples.append((done, core_mb, front_mb))
                print(f"{done:9d} {core_mb:9.1f} {front_mb:9.1f} {time.perf_counter() - t0:7.1f}", flush=True)
                if args.tracemalloc and snap_half is None and done >= args.requests // 2:
                    tracemalloc.start(8)
                    snap_half = tracemalloc.take_snapshot()
        half = [s for s in samples if s[0] >= args.requests // 2]
        core_slope = _slope_per_1000([(n, c) for n, c, _ in half])
        front_slope = _slope_per_1000([(n, f) for n, _, f in half])
        print(f"growth per 1,000 requests over the last half ({half[0][0]}..{half[-1][0]}): "
              f"core {core_slope:+.2f} MB, front-end {front_slope:+.2f} MB; "
              f"total over the last half: core {half[-1][1] - half[0][1]:+.1f} MB, "
              f"front-end {half[-1][2] - half[0][2]:+.1f} MB", flush=True)
        if args.inproc:
            print("structures:", _structure_sizes(llm), flush=True)
            print(f"distinct KV blocks ever handed out: {len(blocks_used)} of "
                  f"{llm.engine_core.engine.scheduler.kv_cache_manager.block_pool.num_blocks}", flush=True)
        if snap_half is not None:
            gc.collect()
            stats = tracemalloc.take_snapshot().compare_to(snap_half, "lineno")
            print("top Python growth over the last half (tracemalloc):")
            for st in stats[:12]:
                print(f"  {st.size_diff / 1024:+9.1f} KiB {st.count_diff:+7d} blocks  {st.traceback[0]}")
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
