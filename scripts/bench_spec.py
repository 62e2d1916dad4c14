"""Speculative decoding's cost and speed, in one run: what one verification step costs, and
single-stream decode speed with and without speculation (n-gram and a draft model).

    python scripts/bench_spec.py [--model DIR] [--num-requests 6] [--output-len 128] [--repeats 2]
                                 [--num-speculative-tokens 4] [--prompt-lookup-min 2] [--prompt-lookup-max 4]
                                 [--methods ngram,draft] [--no-verify-cost]

Verification cost (first): on the embedded default model and on the benchmark checkpoint, the
model runner is fed the same step over and over -- B requests with a 256-token context, each
computing its last token plus k proposals -- and the median step time for k = 1..8 is printed
as a ratio to the plain decode step (k = 0), at batch 1, 8 and 32. That is the price of
verifying k proposals whatever is accepted.

The draft model is a layer-skip draft of the target: its embedding, its first quarter of the
layers, its final norm and LM head (a quarter of its transformer layers, sharing the tokenizer,
made on the spot). A random-weight model has no distilled small sibling; its early layers are
the closest thing, and the acceptance rate printed says how close.

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


def layer_skip_draft(target: str, out: str, fraction: float = 0.25) -> str:
    """A draft checkpoint: `target` with only its first `fraction` of layers (>= 1)."""
    import glob
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(target, "config.json")) as f:
        config = json.load(f)
    keep = max(1, int(config["num_hidden_layers"] * fraction))
    config["num_hidden_layers"] = keep
    if isinstance(config.get("layer_types"), list):  # one entry per layer in newer configs
        config["layer_types"] = config["layer_types"][:keep]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f)
    for name in glob.glob(os.path.join(target, "*token*")) + glob.glob(os.path.join(target, "generation_config.json")):
        shutil.copy(name, out)
    weights = {}
    for path in glob.glob(os.path.join(target, "*.safetensors")):
        for k, v in load_file(path).items():
            parts = k.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= keep:
                continue
            weights[k] = v
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def verify_cost(model: str, label: str, device: str, context: int = 256, repeats: int = 15) -> None:
    """Median time of a step with k proposals per request over a plain decode step, per batch."""
    import numpy as np

    from tidal.protocol import EngineConfig, SamplingParams
    from tidal.protocol.messages import CachedRequestData, NewRequestData, SchedulerOutput
    from tidal.worker.worker import Worker

    ks, batches, block = list(range(0, 9)), [1, 8, 32], 16
    per_req = (context + max(ks) + block) // block
    worker = Worker(EngineConfig(model=model, device=device, dtype="float32", max_num_seqs=max(batches),
                                 num_kv_blocks=per_req * max(batches) + 1, max_model_len=1024, block_size=block,
                                 max_num_batched_tokens=max(batches) * context))
    worker.initialize()
    runner = worker.model_runner
    rng = np.random.default_rng(0)
    vocab = worker.hf_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    line = []
    for b in batches:
        ids = [f"b{b}-{i}" for i in range(b)]
        prompts = {r: rng.integers(3, vocab, context).tolist() for r in ids}
        blocks = {r: list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i, r in enumerate(ids)}
        # the context, less its last token, into the KV cache (no sampling)
        runner.execute_model(SchedulerOutput(
            scheduled_new_reqs=[NewRequestData(r, prompts[r], params, blocks[r], 0) for r in ids],
            num_scheduled_tokens={r: context - 1 for r in ids}, total_num_scheduled_tokens=b * (context - 1)))
        times = {}
        for k in ks:
            so = SchedulerOutput(
                scheduled_cached_reqs=[CachedRequestData(r, [], [], context - 1) for r in ids],
                num_scheduled_tokens={r: 1 + k for r in ids}, total_num_scheduled_tokens=b * (1 + k),
                scheduled_spec_decode_tokens={r: rng.integers(3, vocab, k).tolist() for r in ids} if k else {})
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                runner.execute_model(so)
                samples.append(time.perf_counter() - t0)
            times[k] = statistics.median(samples[2:])
        runner.execute_model(SchedulerOutput(finished_req_ids=ids))
        ratios = " ".join(f"k={k}:{times[k] / times[0]:.2f}" for k in ks[1:])
        line.append(f"  batch {b:2d}: plain step {times[0] * 1e3:6.2f} ms; with k proposals / plain: {ratios}")
    worker.shutdown()
    print(f"verification cost, {label} ({model}):")
    print("\n".join(line))


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


def compare(workload: str, method: str, off: Any, on: Any, prompts: list[list[int]], params: list[Any],
            repeats: int) -> None:
    """Interleaved timed runs of `off` and `on` (off, on, on, off, ...); prints the ratio."""
    engines = {"off": off, "on": on}
    times: dict[str, list[float]] = {"off": [], "on": []}
    outs: dict[str, list[list[int]]] = {}
    stats0 = on.get_stats()
    order = ["off", "on", "on", "off"] * ((repeats + 1) // 2)
    for side in order[: 2 * repeats]:
        dt, toks = run_once(engines[side], prompts, params)
        times[side].append(dt)
        outs[side] = toks
    stats1 = on.get_stats()
    n_tokens = sum(len(t) for t in outs["on"])
    tps = {side: n_tokens / statistics.median(ts) for side, ts in times.items()}
    drafts = stats1.spec_decode_num_drafts - stats0.spec_decode_num_drafts
    proposed = stats1.spec_decode_num_draft_tokens - stats0.spec_decode_num_draft_tokens
    accepted = stats1.spec_decode_num_accepted_tokens - stats0.spec_decode_num_accepted_tokens
    rate = accepted / proposed if proposed else 0.0
    per_step = (accepted + drafts) / drafts if drafts else 0.0
    same = outs["on"] == outs["off"]
    print(f"{workload:10s} {method:5s}: off {tps['off']:7.1f} tok/s, on {tps['on']:7.1f} tok/s, "
          f"ratio {tps['on'] / tps['off']:.2f}x; acceptance {rate:.2f} ({accepted}/{proposed}), "
          f"{per_step:.2f} tokens per speculative step; token-identical: {same}")
    best = min(times["off"]) / min(times["on"])
    print(f"{'':16s}  seconds off {['%.2f' % t for t in times['off']]}, on {['%.2f' % t for t in times['on']]}"
          f" (ratio of the fastest runs {best:.2f}x)")
    if not same:
        sys.exit("outputs differ with speculation on: a bug")


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
    p.add_argument("--methods", default="ngram,draft", help="comma-separated: ngram, draft")
    p.add_argument("--no-verify-cost", action="store_true", help="skip the verification-cost table")
    args = p.parse_args()

    from tidal.frontend import LLM

    tmp = None
    model = args.model
    if model is None:
        tmp = tempfile.mkdtemp(prefix="bench-spec-")
        model = make_checkpoint(os.path.join(tmp, "model"))
    if not args.no_verify_cost:
        from tidal.frontend.entrypoints.make_model import ensure_default_model

        verify_cost(ensure_default_model(), "the embedded default model", args.device)
        verify_cost(model, "the benchmark checkpoint", args.device)
    specs: dict[str, dict[str, Any]] = {}
    for method in args.methods.split(","):
        if method == "ngram":
            specs["ngram"] = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
                              "prompt_lookup_min": args.prompt_lookup_min,
                              "prompt_lookup_max": args.prompt_lookup_max}
        elif method == "draft":
            draft_dir = layer_skip_draft(model, os.path.join(tmp or tempfile.mkdtemp(prefix="bench-spec-"), "draft"))
            specs["draft"] = {"model": draft_dir, "num_speculative_tokens": args.num_speculative_tokens}
        else:
            sys.exit(f"unknown method {method!r}: ngram or draft")
    kw: dict[str, Any] = dict(multiprocessing=False, max_model_len=1024, device=args.device, max_num_seqs=8)
    engines = {"off": LLM(model=model, **kw)}
    engines.update((name, LLM(model=model, speculative_config=spec, **kw)) for name, spec in specs.items())
    vocab = engines["off"].info.vocab_size
    print(f"model {model} on {args.device}; speculative_config {specs}; "
          f"{args.num_requests} requests x {args.output_len} tokens, single stream, {args.repeats} repeats")
    try:
        for name, (prompts, params) in workloads(args.num_requests, vocab, args.output_len).items():
            for llm in engines.values():  # untimed warm-up (first-use costs)
                run_once(llm, prompts[:1], params[:1])
            for method in specs:
                compare(name, method, engines["off"], engines[method], prompts, params, args.repeats)
    finally:
        for llm in engines.values():
            llm.shutdown()
        if tmp is not None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
