"""How much wall time the engine loses to another process's CPU bursts (what `tidal serve`'s
front-end and its clients are to the engine on a small box).

    python scripts/bench_contention.py [--burn-ms 5] [--period-ms 40] [--rounds 6]
        [--num-prompts 64] [--input-len 256] [--output-len 64] [--model DIR]

Runs `LLM.generate` on bench_serving.py's random workload, alone and beside a burner process
that spins `--burn-ms` every `--period-ms` (about the shape of the server front-end's work per
engine step), in alternation (ABBA: the machine's drift favours neither side; every run has its
own prompts, so none hits the prefix cache). It prints the medians and the wall seconds lost per
CPU second the burner took: 0.5 means the two cores were shared perfectly (the engine's two
threads lost half of what the burner took), below that the burner also ran where the engine
left a core idle, 1.0 that the engine stood still while the burner ran (a parallel region
waiting at its barrier for the thread that lost its core), above 1 that it lost more than that
(caches, wake-ups). On a shared machine the figure moves between runs (0.2-1.4 were seen on
one day): compare several runs made minutes apart. The engine's forward-pass seconds are
printed beside the step seconds, to tell the parallel model work from the single-threaded
scheduling.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import sample_requests  # noqa: E402


def burner(burn_s: float, period_s: float, stop: Any) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < burn_s:
            pass
        time.sleep(max(0.0, period_s - burn_s))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model dir (default: the embedded default model)")
    p.add_argument("--burn-ms", type=float, default=5.0, help="the burner spins this long ...")
    p.add_argument("--period-ms", type=float, default=40.0, help="... once per this period")
    p.add_argument("--rounds", type=int, default=6, help="runs on each side")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    if not 0 < args.burn_ms <= args.period_ms or args.rounds < 1:
        p.error("need 0 < --burn-ms <= --period-ms and --rounds >= 1")

    from tidal.frontend import LLM
    from tidal.frontend.entrypoints.make_model import ensure_default_model
    from tidal.protocol import SamplingParams

    model = args.model or ensure_default_model()
    llm = LLM(model)
    tok = llm.get_tokenizer()
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    timing: dict[str, list[tuple[float, float, float]]] = {"alone": [], "beside": []}
    burned: list[float] = []

    def run(seed: int, side: str | None) -> None:
        reqs = sample_requests(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, seed)
        params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0) for r in reqs]
        step0, fwd0, _ = llm.llm_engine.call_utility("get_timing")
        t0 = time.perf_counter()
        llm.generate([{"prompt_token_ids": r.prompt_token_ids} for r in reqs], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        step1, fwd1, _ = llm.llm_engine.call_utility("get_timing")
        if side is not None:
            timing[side].append((wall, step1 - step0, fwd1 - fwd0))

    def beside(seed: int) -> None:
        stop = mp.Event()
        proc = mp.Process(target=burner, args=(args.burn_ms / 1e3, args.period_ms / 1e3, stop), daemon=True)
        proc.start()
        try:
            ps = psutil.Process(proc.pid)
            time.sleep(0.05)  # started and spinning
            t = ps.cpu_times()
            cpu0 = t.user + t.system
            run(seed, "beside")
            t = ps.cpu_times()
            burned.append(t.user + t.system - cpu0)
        finally:
            stop.set()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    try:
        run(10_000, None)  # warm-up: kernels compiled, caches and pools filled
        for k in range(args.rounds):  # ABBA
            if k % 2 == 0:
                run(1_000 + k, "alone")
            beside(2_000 + k)
            if k % 2 == 1:
                run(1_000 + k, "alone")
    finally:
        llm.shutdown()

    med = {side: [statistics.median(x[i] for x in v) for i in range(3)] for side, v in timing.items()}
    cpu = statistics.median(burned)
    for side, (wall, step, fwd) in med.items():
        print(f"{side:>6}: wall {wall:.3f} s, engine steps {step:.3f} s, of which forward {fwd:.3f} s")
    lost = med["beside"][0] - med["alone"][0]
    print(f"burner: {args.burn_ms:g} ms per {args.period_ms:g} ms, {cpu:.3f} CPU s per run")
    print(f"wall seconds lost per burner CPU second: {lost:.3f} / {cpu:.3f} = {lost / cpu:.2f} "
          f"(0.5: the 2 cores shared perfectly, less: idle cores used; 1.0: the engine stalls while it runs)")


if __name__ == "__main__":
    main()
