"""Offline throughput: tidal `LLM.generate` vs transformers `generate`, same checkpoint, one run.

Workload (issue "Engine on one device"): a ~20M-parameter random Qwen3-shaped checkpoint made
on the spot, 32 sequences, prompt lengths U[16, 256], output lengths U[16, 128], ignore_eos.
transformers runs the batch as a user would: one left-padded batch, max_new_tokens = the
longest request, every sequence forced to that length; only the tokens each request asked
for count as useful output for both engines.

Fairness: both engines first run an untimed warm-up workload of the same shape whose prompts
share nothing with the timed ones, and tidal's prefix cache is reset before every timed
repeat, so no timed prompt is ever a cache hit. Each engine is timed --repeats times (default 3) and the median is compared; every
sample is printed.

    python scripts/bench_offline.py [--tensor-parallel-size 2] [--num-seqs 32] [--repeats 3] [--skip-hf]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time


def make_checkpoint(path: str) -> str:
    from tidal.frontend.make_model import make_model

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


def run_tidal(model: str, prompts: list[list[int]], outputs: list[int], tp: int, repeats: int,
              warm: tuple[list[list[int]], list[int]]) -> tuple[list[float], dict]:
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    llm = LLM(model=model, dtype="float32", tensor_parallel_size=tp, max_num_seqs=256,
              max_num_batched_tokens=4096, max_model_len=1024, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in outputs]
    llm.generate([{"prompt_token_ids": p} for p in warm[0]],
                 [SamplingParams(temperature=0.0, max_tokens=o, ignore_eos=True) for o in warm[1]], use_tqdm=False)
    times: list[float] = []
    timings: list[dict] = []
    for _ in range(repeats):
        assert llm.reset_prefix_cache()
        step0, fwd0, n0 = llm.llm_engine.call_utility("get_timing")  # cumulative (step s, forward s, steps)
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
        step1, fwd1, n1 = llm.llm_engine.call_utility("get_timing")
        timings.append({"step_s": step1 - step0, "forward_s": fwd1 - fwd0, "steps": n1 - n0})
        got = sum(len(r.outputs[0].token_ids) for r in results)
        assert got == sum(outputs), (got, sum(outputs))
        assert all(r.num_cached_tokens == 0 for r in results), "a timed prompt hit the prefix cache"
    llm.shutdown()
    median = sorted(range(repeats), key=lambda i: times[i])[repeats // 2]
    return times, timings[median] | {"wall_s": times[median]}


def run_hf(model: str, prompts: list[list[int]], outputs: list[int], repeats: int,
           warm: tuple[list[list[int]], list[int]]) -> list[float]:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    pad = 0

    def batch(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in seqs)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in seqs])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in seqs])
        return ids, mask

    ids, mask = batch(prompts)
    new = max(outputs)
    kwargs = dict(do_sample=False, max_new_tokens=new, min_new_tokens=new, pad_token_id=pad)
    times = []
    with torch.inference_mode():
        w_ids, w_mask = batch(warm[0])
        w_new = max(warm[1])
        hf.generate(input_ids=w_ids, attention_mask=w_mask, do_sample=False, max_new_tokens=w_new,
                    min_new_tokens=w_new, pad_token_id=pad)
        for _ in range(repeats):
            t0 = time.perf_counter()
            out = hf.generate(input_ids=ids, attention_mask=mask, **kwargs)
            times.append(time.perf_counter() - t0)
            assert out.shape[1] == ids.shape[1] + new
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model", default=None, help="an existing checkpoint (default: make one)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine; medians are compared")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_checkpoint(os.path.join(tmp, "qwen3-20m"))
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model)
        prompts, outputs = workload(args.num_seqs, cfg.vocab_size, args.seed)
        warm = warmup_workload(args.num_seqs, cfg.vocab_size, args.seed)
        useful = sum(outputs)
        times, timing = run_tidal(model, prompts, outputs, args.tensor_parallel_size, args.repeats, warm)
        t_tidal = statistics.median(times)
        tidal_tps = useful / t_tidal
        overhead = 1.0 - timing["forward_s"] / timing["wall_s"]
        print(f"workload: {args.num_seqs} seqs, prompt tokens {sum(map(len, prompts))}, "
              f"output tokens {useful} (U[16,256] / U[16,128], ignore_eos)")
        print(f"tidal LLM.generate (tp={args.tensor_parallel_size}): median {t_tidal:.2f} s, "
              f"{tidal_tps:,.0f} output tokens/s  (runs: {', '.join(f'{t:.2f}' for t in times)} s)")
        print(f"  engine overhead: {overhead:.1%} of wall time outside the model forward "
              f"(forward {timing['forward_s']:.2f} s, engine steps {timing['step_s']:.2f} s; "
              f"scheduling/inputs/sampling {1 - timing['forward_s'] / timing['step_s']:.1%} of step "
              f"time, front-end + IPC + idle {1 - timing['step_s'] / timing['wall_s']:.1%} of wall)")
        per_step = (timing["step_s"] - timing["forward_s"]) / max(timing["steps"], 1)
        print(f"  {timing['steps']} engine steps; per step outside the forward (schedule, inputs, "
              f"sampling, and with tp > 1 the broadcast to the ranks and rank 0's reply): "
              f"{per_step * 1e3:.2f} ms")
        if not args.skip_hf:
            hf_times = run_hf(model, prompts, outputs, args.repeats, warm)
            t_hf = statistics.median(hf_times)
            hf_tps = useful / t_hf
            print(f"transformers generate (left-padded batch): median {t_hf:.2f} s, {hf_tps:,.0f} useful "
                  f"output tokens/s  (runs: {', '.join(f'{t:.2f}' for t in hf_times)} s)")
            print(f"ratio tidal / transformers: {tidal_tps / hf_tps:.2f}x (medians)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
