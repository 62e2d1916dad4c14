"""Structured-output overhead: throughput with 25% of the batch under a JSON schema vs none, one run.

Workload: the ~20M-parameter random Qwen3-shaped checkpoint of bench_offline.py (vocab 8192),
--num-seqs sequences (default 64), prompt lengths U[16, 256], temperature 1, seeded.
- constrained: every 4th request follows SCHEMA (xgrammar, no whitespace) and ends where its
  grammar ends; the others generate U[16, 128] tokens (ignore_eos).
- plain: the same requests without any constraint, each constrained one given max_tokens equal
  to the tokens its twin generated, so both runs produce the same tokens per request and the
  batch shrinks in the same way: the only difference is grammar work (compile is cached after
  the warm-up; per step: matchers, bitmask filling, masking the logits).
Runs alternate (plain, constrained) --repeats times after one untimed warm-up of each; the
medians are compared. Ratio = constrained throughput / plain throughput (goal >= 0.9).

The engine core runs in this process (multiprocessing=False) so that three figures come from
one place: wall time; CPU time (process_time, all threads: far less sensitive than wall time to
other work on a shared machine); and the time spent in the grammar work itself (bitmask
filling, matcher advances, masking the logits), timed by wrapping those functions.

    python scripts/bench_structured.py [--num-seqs 64] [--repeats 3] [--model DIR]
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

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999999},
        "name": {"type": "string", "pattern": "^[a-z]{1,12}$"},
        "kind": {"enum": ["alpha", "beta", "gamma", "delta"]},
        "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                   "minItems": 2, "maxItems": 8},
        "owner": {"type": "object", "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
                                                   "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
                  "required": ["city", "zip"]},
    },
    "required": ["id", "name", "kind", "scores", "owner"],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-seqs", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="an existing checkpoint (default: make one)")
    args = ap.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_offline import make_checkpoint

    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams, StructuredOutputsParams

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_checkpoint(os.path.join(tmp, "qwen3-20m"))
        llm = LLM(model=model, max_num_seqs=256, max_num_batched_tokens=4096, max_model_len=1024, seed=0,
                  multiprocessing=False)
        grammar_s = _time_grammar_work()
        so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)

        def workload(seed: int) -> tuple[list[dict], list[SamplingParams]]:
            rng = random.Random(seed)
            prompts = [{"prompt_token_ids": [rng.randrange(10, 8000) for _ in range(rng.randint(16, 256))]}
                       for _ in range(args.num_seqs)]
            params = [SamplingParams(temperature=1.0, seed=seed * 1000 + i, max_tokens=400, structured_outputs=so)
                      if i % 4 == 0 else
                      SamplingParams(temperature=1.0, seed=seed * 1000 + i, max_tokens=rng.randint(16, 128),
                                     ignore_eos=True) for i in range(args.num_seqs)]
            return prompts, params

        cpu: dict[str, list[float]] = {"plain": [], "json": []}
        work: list[float] = []

        def run(prompts: list[dict], params: list[SamplingParams]) -> tuple[float, list[int], int]:
            assert llm.reset_prefix_cache()
            g0, c0, t0 = grammar_s[0], time.process_time(), time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            elapsed = time.perf_counter() - t0
            constrained = any(p.structured_outputs is not None for p in params)
            cpu["json" if constrained else "plain"].append(time.process_time() - c0)
            if constrained:
                work.append(grammar_s[0] - g0)
            lens = [len(o.outputs[0].token_ids) for o in outs]
            bad = [o.outputs[0].finish_reason for o, p in zip(outs, params)
                   if p.structured_outputs is not None and o.outputs[0].finish_reason != "stop"]
            return elapsed, lens, len(bad)

        def plain_twin(params: list[SamplingParams], lens: list[int]) -> list[SamplingParams]:
            return [p.clone(structured_outputs=None, max_tokens=n, ignore_eos=True)
                    if p.structured_outputs is not None else p for p, n in zip(params, lens)]

        prompts, params = workload(args.seed + 1)  # untimed warm-up of both (compiles the schema)
        _, lens, _ = run(prompts, params)
        run(prompts, plain_twin(params, lens))
        prompts, params = workload(args.seed)
        plain_s: list[float] = []
        constrained_s: list[float] = []
        for _ in range(args.repeats):
            elapsed, lens, unfinished = run(prompts, params)
            constrained_s.append(elapsed)
            twin = plain_twin(params, lens)
            plain_elapsed, plain_lens, _ = run(prompts, twin)
            assert plain_lens == lens, "the plain twin must generate the same tokens per request"
            plain_s.append(plain_elapsed)
        llm.shutdown()
    tokens = sum(lens)
    constrained_tokens = sum(n for n, p in zip(lens, params) if p.structured_outputs is not None)
    c, p = statistics.median(constrained_s), statistics.median(plain_s)
    cc, cp = statistics.median(cpu["json"][1:]), statistics.median(cpu["plain"][1:])  # [0]: warm-up
    w = statistics.median(work[1:])
    print(f"model {model}: {args.num_seqs} seqs, {tokens} output tokens per run "
          f"({constrained_tokens} under the JSON schema, {unfinished} constrained outputs cut by max_tokens)")
    rows = (("plain", p, plain_s, cpu["plain"][1:]), ("25% JSON", c, constrained_s, cpu["json"][1:]))
    for name, t, walls, cpus in rows:
        print(f"{name:<9} {tokens / t:8.1f} tok/s  wall runs (s): {_list(walls)}  cpu (s): {_list(cpus)}")
    print(f"grammar work per 25%-JSON run (fill bitmask + accept + mask logits): {w:.3f} s (median)")
    print(f"ratio (25% JSON / plain throughput): wall {p / c:.3f}, cpu time {cp / cc:.3f}  (goal >= 0.9)")


def _list(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values)


def _time_grammar_work() -> list[float]:
    """Wrap the per-step grammar functions; returns a 1-list accumulating their seconds."""
    from tidal.core.structured_output import StructuredOutputManager, StructuredOutputRequest
    from tidal.worker.model_runner import ModelRunner

    total = [0.0]

    def timed(owner: Any, name: str, static: bool = False) -> None:
        fn = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[0] += time.perf_counter() - t0

        setattr(owner, name, staticmethod(wrapper) if static else wrapper)

    timed(StructuredOutputManager, "fill_bitmask")
    timed(StructuredOutputRequest, "accept_token")
    timed(StructuredOutputRequest, "is_terminated")
    timed(ModelRunner, "_apply_grammar_bitmask", static=True)
    return total


if __name__ == "__main__":
    main()
