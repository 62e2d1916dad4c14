"""Single-stream decode speed with and without n-gram speculative decoding, in one run.

    python scripts/bench_spec.py [--model DIR] [--num-requests 6] [--output-len 128] [--repeats 2]
                                 [--num-speculative-tokens 4] [--prompt-lookup-min 2] [--prompt-lookup-max 4]

Two engines on the same checkpoint (default: a ~20M-parameter random Qwen3 made on the spot,
bench_offline.py's shape with HF's small init_std 0.02), one with
speculative_config={"method": "ngram", ...} and one without, each serving one request at a time
(single stream), on two workloads:

- repetitive: prompts that repeat a phrase, greedy. A random-weight model does not copy its
  prompt as a real one does on code edits or extraction; this one's greedy outputs repeat
  themselves instead (it falls into a loop at once), which the n-gram finds: acceptance is near
  its ceiling, so the figure is the best case of verification cost against decode cost.
- random: random prompts, temperature 0.8 seeded: the n-gram (almost) never matches, so this
  is the cost of looking and of the odd wasted proposal.

The engines' timed runs alternate (off, on, on, off, ...) so the machine's drift favours
neither; the prefix cache is reset before each. On a small shared machine run it with
OMP_NUM_THREADS=1: two OpenMP threads on two busy cores stall at their barriers and a run then
takes 10x longer at random. Even so, two engines with the same (speculation-off) config read
0.88-1.00x of each other there: ratios within about 10% of 1 are noise. Printed per workload: output tok/s of each
(median over repeats), the ratio on/off, the acceptance rate (accepted / proposed tokens) and
the mean tokens per speculative step, and whether the outputs were token-identical (they must
be: speculation never changes a token).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any


def make_checkpoint(path: str) -> str:
    from tidal.frontend.entrypoints.make_model import make_model

    return make_model(path, arch="qwen3", vocab_size=8192, hidden_size=512, num_layers=6,
                      num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536,
                      max_position_embeddings=1024, seed=0, init_std=0.02)


def workloads(n: int, vocab: int, output_len: int) -> dict[str, tuple[list[list[int]], list[Any]]]:
    from tidal.protocol import SamplingParams

    rng = random.Random(0)
    repetitive = []
    for _ in range(n):
        phrase = [rng.randrange(10, vocab) for _ in range(rng.randint(6, 16))]
        repetitive.append(phrase * 4 + phrase[: len(phrase) // 2])
    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    rand = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 64))] for _ in range(n)]
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=output_len, ignore_eos=True) for i in range(n)]
    return {"repetitive": (repetitive, [greedy] * n), "random": (rand, seeded)}


def run_once(llm: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list[list[int]]]:
    """Wall seconds to serve the prompts one after another, and the tokens."""
    llm.reset_prefix_cache()
    tokens = []
    t0 = time.perf_counter()
    for prompt, sp in zip(prompts, params):
        out = llm.generate({"prompt_token_ids": prompt}, sp, use_tqdm=False)
        tokens.append(list(out[0].outputs[0].token_ids))
    return time.perf_counter() - t0, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: a ~20M random Qwen3 made now)")
    p.add_argument("--num-requests", type=int, default=6)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=4)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    from tidal.frontend import LLM

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.mkdtemp(prefix="bench-spec-")
        model = make_checkpoint(os.path.join(tmp, "model"))
    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_min": args.prompt_lookup_min, "prompt_lookup_max": args.prompt_lookup_max}
    kw: dict[str, Any] = dict(multiprocessing=False, max_model_len=1024, device=args.device, max_num_seqs=8)
    engines = {"off": LLM(model=model, **kw), "on": LLM(model=model, speculative_config=spec, **kw)}
    vocab = engines["off"].info.vocab_size
    print(f"model {model} on {args.device}; speculative_config {spec}; "
          f"{args.num_requests} requests x {args.output_len} tokens, single stream, {args.repeats} repeats")
    try:
        for name, (prompts, params) in workloads(args.num_requests, vocab, args.output_len).items():
            for llm in engines.values():  # untimed warm-up (first-use costs)
                run_once(llm, prompts[:1], params[:1])
            times: dict[str, list[float]] = {"off": [], "on": []}
            outs: dict[str, list[list[int]]] = {}
            stats0 = engines["on"].get_stats()
            order = ["off", "on", "on", "off"] * ((args.repeats + 1) // 2)
            for side in order[: 2 * args.repeats]:
                dt, toks = run_once(engines[side], prompts, params)
                times[side].append(dt)
                outs[side] = toks
            stats1 = engines["on"].get_stats()
            n_tokens = sum(len(t) for t in outs["on"])
            tps = {side: n_tokens / statistics.median(ts) for side, ts in times.items()}
            drafts = stats1.spec_decode_num_drafts - stats0.spec_decode_num_drafts
            proposed = stats1.spec_decode_num_draft_tokens - stats0.spec_decode_num_draft_tokens
            accepted = stats1.spec_decode_num_accepted_tokens - stats0.spec_decode_num_accepted_tokens
            rate = accepted / proposed if proposed else 0.0
            per_step = (accepted + drafts) / drafts if drafts else 0.0
            same = outs["on"] == outs["off"]
            print(f"{name:10s}: off {tps['off']:7.1f} tok/s, on {tps['on']:7.1f} tok/s, "
                  f"ratio {tps['on'] / tps['off']:.2f}x; "
                  f"acceptance {rate:.2f} ({accepted}/{proposed}), {per_step:.2f} tokens per speculative step; "
                  f"token-identical: {same}")
            best = min(times["off"]) / min(times["on"])
            print(f"{'':10s}  seconds off {['%.2f' % t for t in times['off']]}, on {['%.2f' % t for t in times['on']]}"
                  f" (ratio of the fastest runs {best:.2f}x)")
            if not same:
                sys.exit("outputs differ with speculation on: a bug")
    finally:
        for llm in engines.values():
            llm.shutdown()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
