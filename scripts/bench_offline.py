"""Offline throughput: tidal `LLM.generate` vs transformers `generate`, same checkpoint, one run.

Workload (issue "Engine on one device"): a ~20M-parameter random Qwen3-shaped checkpoint made
on the spot, 32 sequences, prompt lengths U[16, 256], output lengths U[16, 128], ignore_eos.
transformers runs the batch as a user would: one left-padded batch, max_new_tokens = the
longest request, every sequence forced to that length; only the tokens each request asked
for count as useful output for both engines.

Fairness: both engines first run an untimed warm-up workload of the same shape whose prompts
share nothing with the timed ones, and tidal's prefix cache is reset before every timed
repeat, so no timed prompt is ever a cache hit. Each engine is timed --repeats times (default 3) and the
median is compared; every sample is printed. The engines' timed runs alternate (see run_engines).
--cold first times each engine freshly started, after one 4-token request, --cold-trials times
each (see cold_trials).

    python scripts/bench_offline.py [--tensor-parallel-size 2] [--num-seqs 32] [--repeats 3] [--skip-hf]
                                    [--cold [--cold-trials 3]] [--half bfloat16|float16]
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable


def make_checkpoint(path: str) -> str:
    from tidal.frontend.entrypoints.make_model import make_model

    return make_model(path, arch="qwen3", vocab_size=8192, hidden_size=512, num_layers=6,
                      num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536,
                      max_position_embeddings=1024, seed=0)


def workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(16, 256))] for _ in range(n)]
    outputs = [rng.randint(16, 128) for _ in range(n)]
    return prompts, outputs


def warmup_workload(n: int, vocab: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """A workload of the same shape for the untimed warm-up run of each engine (so one-time
    costs, e.g. oneDNN building a kernel per new batch size or the heap growing, are paid
    before timing, for both). Every prompt starts with token 3, which no timed prompt has
    (those draw from [10, vocab)), so the warm-up leaves nothing in the prefix cache to hit."""
    prompts, outputs = workload(n, vocab, seed + 1)
    return [[3] + p[1:] for p in prompts], outputs


COLD_WARMUP = ([[3, 11, 12, 13]], [4])  # --cold: one request, 4 prompt tokens, 4 output tokens
_HF_COLD_TIMEOUT_S = 600


class TidalRunner:
    """One `LLM` on the benchmark's checkpoint, timed one workload at a time."""

    def __init__(self, model: str, tp: int, dtype: str = "float32") -> None:
        from tidal.frontend import LLM

        self.llm = LLM(model=model, dtype=dtype, tensor_parallel_size=tp, max_num_seqs=256,
                       max_num_batched_tokens=4096, max_model_len=1024, seed=0)

    def generate(self, work: tuple[list[list[int]], list[int]]) -> list:
        from tidal.protocol import SamplingParams

        return self.llm.generate([{"prompt_token_ids": p} for p in work[0]],
                                 [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in work[1]],
                                 use_tqdm=False)

    def timed_run(self, work: tuple[list[list[int]], list[int]]) -> tuple[float, dict]:
        """(seconds, the engine's step/forward time and step count over the run)."""
        assert self.llm.reset_prefix_cache()
        step0, fwd0, n0 = self.llm.llm_engine.call_utility("get_timing")  # cumulative (step s, forward s, steps)
        t0 = time.perf_counter()
        results = self.generate(work)
        elapsed = time.perf_counter() - t0
        step1, fwd1, n1 = self.llm.llm_engine.call_utility("get_timing")
        got = sum(len(r.outputs[0].token_ids) for r in results)
        assert got == sum(work[1]), (got, sum(work[1]))
        assert all(r.num_cached_tokens == 0 for r in results), "a timed prompt hit the prefix cache"
        return elapsed, {"step_s": step1 - step0, "forward_s": fwd1 - fwd0, "steps": n1 - n0, "wall_s": elapsed}

    def shutdown(self) -> None:
        self.llm.shutdown()


class HFRunner:
    """transformers `generate` on the same checkpoint, the batch as a user would run it."""

    def __init__(self, model: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()

    def generate(self, work: tuple[list[list[int]], list[int]]) -> float:
        torch, pad = self.torch, 0
        width = max(len(p) for p in work[0])
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in work[0]])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in work[0]])
        new = max(work[1])
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = self.hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=new,
                                   min_new_tokens=new, pad_token_id=pad)
            elapsed = time.perf_counter() - t0
        assert out.shape[1] == ids.shape[1] + new
        return elapsed

    def timed_run(self, work: tuple[list[list[int]], list[int]]) -> tuple[float, dict]:
        elapsed = self.generate(work)
        return elapsed, {"wall_s": elapsed}

    def shutdown(self) -> None:
        del self.hf


def run_engines(factories: dict[str, Callable[[], TidalRunner | HFRunner]], work: tuple[list[list[int]], list[int]],
                repeats: int, warm: tuple[list[list[int]], list[int]]) -> dict[str, list[dict]]:
    """{engine: timings of its timed runs}. Each engine runs the warm-up workload, then the
    timed runs alternate between the engines, the order reversed every round (ABBA...): this
    machine's speed drifts by more than the differences measured over the minute one engine's
    runs would take back to back."""
    runners: dict[str, TidalRunner | HFRunner] = {}
    try:
        for name, make in factories.items():
            runners[name] = runner = make()
            runner.generate(warm)
        timings: dict[str, list[dict]] = {name: [] for name in runners}
        names = list(runners)
        for r in range(repeats):
            for name in names if r % 2 == 0 else reversed(names):
                timings[name].append(runners[name].timed_run(work)[1])
    finally:
        for runner in runners.values():
            runner.shutdown()
    return timings


def cold_trials(model: str, work: tuple[list[list[int]], list[int]], tp: int, trials: int,
                skip_hf: bool, seed: int) -> tuple[list[float], list[float]]:
    """(tidal's cold times, transformers' cold times): in each trial a freshly started engine
    serves COLD_WARMUP and then the timed workload, as a new user's first batch would. tidal
    starts a new LLM (a new engine core) per trial; transformers runs in a new process per
    trial (in this one, oneDNN's kernels from the last trial would still be built). The two
    alternate, the order reversed every trial."""
    tidal_s: list[float] = []
    hf_s: list[float] = []

    def tidal_cold() -> None:
        runner = TidalRunner(model, tp)
        try:
            runner.generate(COLD_WARMUP)
            tidal_s.append(runner.timed_run(work)[0])
        finally:
            runner.shutdown()

    def hf_cold() -> None:
        cmd = [sys.executable, os.path.abspath(__file__), "--hf-cold-child", "--model", model,
               "--num-seqs", str(len(work[0])), "--seed", str(seed)]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=_HF_COLD_TIMEOUT_S).stdout
        hf_s.append(json.loads(out.strip().splitlines()[-1])["cold_s"])

    for t in range(trials):
        order = [tidal_cold] + ([] if skip_hf else [hf_cold])
        for run in order if t % 2 == 0 else reversed(order):
            run()
    return tidal_s, hf_s


def hf_cold_child(model: str, num_seqs: int, seed: int) -> None:
    """One transformers cold trial (see cold_trials), its time printed as a JSON line."""
    with open(os.path.join(model, "config.json")) as f:
        vocab_size = json.load(f)["vocab_size"]
    runner = HFRunner(model)
    runner.generate(COLD_WARMUP)
    print(json.dumps({"cold_s": runner.generate(workload(num_seqs, vocab_size, seed))}), flush=True)


def median_run(timings: list[dict]) -> dict:
    return sorted(timings, key=lambda t: t["wall_s"])[len(timings) // 2]


def _runs(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def _ratios(slower: list[float], faster: list[float]) -> str:
    """Speed-up per round (the runs of a round are neighbours in time)."""
    return ", ".join(f"{a / b:.2f}" for a, b in zip(slower, faster))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="an existing checkpoint (default: make one)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine; medians are compared")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--cold", action="store_true",
                    help="first time each engine, freshly started, after only a 4-token warm-up request (a new "
                         "user's first batch), then warm up and time as usual")
    ap.add_argument("--cold-trials", type=int, default=1,
                    help="with --cold: fresh starts per engine (alternating); medians are compared")
    ap.add_argument("--hf-cold-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--half", choices=("bfloat16", "float16"), default=None,
                    help="also run tidal with this weight/KV dtype and compare with its float32 run")
    args = ap.parse_args()
    if args.hf_cold_child:
        hf_cold_child(args.model, args.num_seqs, args.seed)
        return
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_checkpoint(os.path.join(tmp, "qwen3-20m"))
        with open(os.path.join(model, "config.json")) as f:
            vocab_size = json.load(f)["vocab_size"]
        prompts, outputs = workload(args.num_seqs, vocab_size, args.seed)
        warm = warmup_workload(args.num_seqs, vocab_size, args.seed)
        useful = sum(outputs)
        factories: dict[str, Callable[[], TidalRunner | HFRunner]] = {
            "tidal": lambda: TidalRunner(model, args.tensor_parallel_size)}
        if args.half:
            factories["half"] = lambda: TidalRunner(model, args.tensor_parallel_size, dtype=args.half)
        if not args.skip_hf:
            factories["hf"] = lambda: HFRunner(model)
        cold_tidal, cold_hf = (cold_trials(model, (prompts, outputs), args.tensor_parallel_size, args.cold_trials,
                                           args.skip_hf, args.seed) if args.cold else ([], []))
        timings = run_engines(factories, (prompts, outputs), args.repeats, warm)
        times = [t["wall_s"] for t in timings["tidal"]]
        timing = median_run(timings["tidal"])
        t_tidal = statistics.median(times)
        tidal_tps = useful / t_tidal
        overhead = 1.0 - timing["forward_s"] / timing["wall_s"]
        print(f"workload: {args.num_seqs} seqs, prompt tokens {sum(map(len, prompts))}, "
              f"output tokens {useful} (U[16,256] / U[16,128], ignore_eos); timed runs of the engines alternate")
        if cold_tidal:
            t_cold = statistics.median(cold_tidal)
            print(f"tidal cold (fresh start, one 4-token request first): median {t_cold:.2f} s, "
                  f"{useful / t_cold:,.0f} output tokens/s  (trials: {_runs(cold_tidal)} s)")
        print(f"tidal LLM.generate (tp={args.tensor_parallel_size}): median {t_tidal:.2f} s, "
              f"{tidal_tps:,.0f} output tokens/s  (runs: {_runs(times)} s)")
        print(f"  engine overhead: {overhead:.1%} of wall time outside the model forward "
              f"(forward {timing['forward_s']:.2f} s, engine steps {timing['step_s']:.2f} s; "
              f"scheduling/inputs/sampling {1 - timing['forward_s'] / timing['step_s']:.1%} of step "
              f"time, front-end + IPC + idle {1 - timing['step_s'] / timing['wall_s']:.1%} of wall)")
        per_step = (timing["step_s"] - timing["forward_s"]) / max(timing["steps"], 1)
        print(f"  {timing['steps']} engine steps; per step outside the forward (schedule, inputs, "
              f"sampling, and with tp > 1 the broadcast to the ranks and rank 0's reply): "
              f"{per_step * 1e3:.2f} ms")
        if args.half:
            half_times = [t["wall_s"] for t in timings["half"]]
            t_half = statistics.median(half_times)
            print(f"tidal {args.half}: median {t_half:.2f} s, {useful / t_half:,.0f} output tokens/s  "
                  f"(runs: {_runs(half_times)} s)")
            print(f"ratio tidal {args.half} / float32: {t_tidal / t_half:.2f}x (medians); per round: "
                  f"{_ratios(times, half_times)}")
        if not args.skip_hf:
            hf_times = [t["wall_s"] for t in timings["hf"]]
            t_hf = statistics.median(hf_times)
            hf_tps = useful / t_hf
            if cold_hf:
                print(f"transformers cold (fresh process, one 4-token request first): median "
                      f"{statistics.median(cold_hf):.2f} s  (trials: {_runs(cold_hf)} s)")
                cold_ratio = statistics.median(cold_hf) / statistics.median(cold_tidal)
                print(f"ratio tidal / transformers, cold: {cold_ratio:.2f}x (medians); per trial: "
                      f"{_ratios(cold_hf, cold_tidal)}")
            print(f"transformers generate (left-padded batch): median {t_hf:.2f} s, {hf_tps:,.0f} useful "
                  f"output tokens/s  (runs: {_runs(hf_times)} s)")
            print(f"ratio tidal / transformers: {tidal_tps / hf_tps:.2f}x (medians); per round: "
                  f"{_ratios(hf_times, times)}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
