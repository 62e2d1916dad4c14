"""Single-stream decode: tok/s at batch 1, 2, 4 per weight dtype against this machine's memory floor.

A decode step at batch <= 4 reads every weight once (plus each sequence's KV cache), so its
floor is (bytes read per step) / (read bandwidth). One run measures, on bench_offline.py's
checkpoint (~20M-parameter Qwen3 shape, made on the spot):
  - the read bandwidth: a STREAM-like sum over a float32 buffer far larger than the caches,
    both cores, best of several passes;
  - per dtype (float32, bfloat16, float16, and int8 = `quantization="int8"` on float32) and
    batch b: b prompts of --prompt-len tokens, --gen tokens each (ignore_eos, greedy); the decode
    time is generate(gen tokens) minus generate(1 token) (the prefill), so tok/s counts only
    decode steps; the same for every row;
  - bytes read per step: the packed weights of every linear layer (the LM head included; the
    embedding reads b rows) + the KV cache read at the mean context length;
  - % of floor: floor time / measured time per step.
Also (--parity, default on when int8 runs): int8 vs float32 on the same prompts, greedy token
agreement and the mean / max |logprob difference| of the chosen tokens.

    python scripts/bench_single_stream.py [--dtypes float32,bfloat16,float16,int8] [--batches 1,2,4]
                                          [--prompt-len 128] [--gen 256] [--repeats 2]
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import make_checkpoint  # noqa: E402  (the same checkpoint as the batched bench)


def read_bandwidth(gib: float = 1.0, passes: int = 5) -> float:
    """Bytes/s of a parallel sum over `gib` GiB of float32 (best pass): the rate a step's
    weights can stream from DRAM at best."""
    import torch

    buf = torch.ones(int(gib * (1 << 30)) // 4)
    best = float("inf")
    for _ in range(passes):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def model_bytes(path: str, dtype: str) -> tuple[int, int]:
    """(bytes of the linear layers' weights incl. the LM head, KV bytes per token of context),
    from the config: what a decode step reads per step / per token of context."""
    import json

    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    h, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    per_layer = h * (q + 2 * kv) + q * h + h * 2 * inter + inter * h
    params = layers * per_layer + cfg["vocab_size"] * h
    if dtype == "int8":  # 32 int8 values + one float32 scale per block; KV stays float32
        return params * 36 // 32, layers * 2 * kv * 4
    elt = 4 if dtype == "float32" else 2
    return params * elt, layers * 2 * kv * elt


def make_llm(model: str, dtype: str) -> object:
    from tidal.frontend import LLM

    kwargs = {"quantization": "int8", "dtype": "float32"} if dtype == "int8" else {"dtype": dtype}
    return LLM(model=model, max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=1024, seed=0, **kwargs)


def generate(llm: object, prompts: list[list[int]], tokens: int, logprobs: bool = False) -> list:
    from tidal.protocol import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0 if logprobs else None)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], [sp] * len(prompts), use_tqdm=False)


def decode_seconds(llm: object, prompts: list[list[int]], gen: int, repeats: int) -> float:
    """Median over repeats of (time of gen tokens - time of 1 token): the decode steps alone."""
    samples = []
    for _ in range(repeats):
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        generate(llm, prompts, 1)
        prefill = time.perf_counter() - t0
        llm.reset_prefix_cache()
        t0 = time.perf_counter()
        out = generate(llm, prompts, gen)
        full = time.perf_counter() - t0
        assert all(len(o.outputs[0].token_ids) == gen for o in out)
        samples.append(full - prefill)
    return statistics.median(samples)


def parity(model: str, prompts: list[list[int]], gen: int) -> None:
    """int8 vs float32 on the same greedy requests: token agreement up to the first divergence
    per sequence, and |logprob difference| of the float32 run's tokens while they agree."""
    runs = {}
    for dtype in ("float32", "int8"):
        llm = make_llm(model, dtype)
        try:
            runs[dtype] = generate(llm, prompts, gen, logprobs=True)
        finally:
            llm.shutdown()
    agree = total = 0
    diffs: list[float] = []
    for ref, got in zip(runs["float32"], runs["int8"]):
        r, g = ref.outputs[0], got.outputs[0]
        total += len(r.token_ids)
        for i, (a, b) in enumerate(zip(r.token_ids, g.token_ids)):
            if a != b:
                break
            agree += 1
            diffs.append(abs(r.logprobs[i][a].logprob - g.logprobs[i][b].logprob))
    print(f"int8 vs float32 parity ({len(prompts)} greedy sequences of {gen} tokens): "
          f"{agree / total:.1%} of tokens before the first divergence; |logprob diff| "
          f"mean {statistics.mean(diffs):.4f}, max {max(diffs):.4f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", default="float32,bfloat16,float16,int8")
    ap.add_argument("--batches", default="1,2,4")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default=None, help="an existing checkpoint (default: make one)")
    args = ap.parse_args()
    dtypes = args.dtypes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or make_checkpoint(os.path.join(tmp, "qwen3-20m"))
        rng = random.Random(0)
        bw = read_bandwidth()
        print(f"read bandwidth (parallel sum over 1 GiB, best of 5): {bw / 1e9:.1f} GB/s; load: "
              f"{os.getloadavg()[0]:.2f}")
        context = args.prompt_len + args.gen / 2
        for dtype in dtypes:
            llm = make_llm(model, dtype)
            try:
                generate(llm, [[3] * args.prompt_len], 8)  # warm-up
                for b in batches:
                    prompts = [[rng.randrange(10, 8000) for _ in range(args.prompt_len)] for _ in range(b)]
                    dt = decode_seconds(llm, prompts, args.gen, args.repeats)
                    steps = args.gen - 1
                    wbytes, kv_per_tok = model_bytes(model, dtype)
                    read = wbytes + b * kv_per_tok * context
                    floor = read / bw
                    print(f"{dtype:>8} batch {b}: {b * steps / dt:7.1f} tok/s ({steps / dt:6.1f} per sequence), "
                          f"{dt / steps * 1e3:6.2f} ms/step; reads {read / 1e6:.1f} MB/step "
                          f"(weights {wbytes / 1e6:.1f}); floor {floor * 1e3:.2f} ms = "
                          f"{floor / (dt / steps):.0%} of floor")
            finally:
                llm.shutdown()
        if "int8" in dtypes:
            parity(model, [[rng.randrange(10, 8000) for _ in range(args.prompt_len)] for _ in range(4)], 64)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
