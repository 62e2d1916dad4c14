"""Offline MoE throughput: tidal on a scaled-down Qwen3-MoE against transformers on the same
checkpoint, and against a dense model with the same active parameter count, in one run.

Models (random weights, made on the spot): the MoE is scripts/bench_offline.py's benchmark model
(Qwen3 shape, hidden 512, 6 layers, 8/4 heads, vocab 8192) with every MLP replaced by 8 experts
of width 768, 2 routed per token (renormalized, as Qwen3-30B-A3B): each token runs 2 x 768 =
1536 columns of expert MLP, so its active parameters are the dense benchmark model's (MLP width
1536) plus the router (8 x 512 per layer). The dense model is that benchmark model itself.

Workload and method: bench_offline.py's (32 sequences, prompts U[16, 256], outputs U[16, 128],
ignore_eos; an untimed warm-up per engine; timed runs alternating between the engines, medians
compared). Figures to read: tidal MoE / transformers MoE (issue 34's goal >= 3x) and tidal MoE /
tidal dense (goal >= 0.7).

    python scripts/bench_moe.py [--num-seqs 32] [--repeats 3] [--skip-hf] [--tensor-parallel-size 2]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_offline import (  # noqa: E402
    HFRunner,
    TidalRunner,
    _ratios,
    _runs,
    make_checkpoint,
    run_engines,
    warmup_workload,
    workload,
)

NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 8, 2, 768


def make_moe_checkpoint(path: str) -> str:
    """bench_offline's model with its MLPs as 8 experts of width 768, top-2 (see above)."""
    from tidal.frontend.entrypoints.make_model import make_model

    return make_model(path, arch="qwen3_moe", vocab_size=8192, hidden_size=512, num_layers=6,
                      num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536,
                      num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH,
                      max_position_embeddings=1024, seed=0, config_overrides=dict(norm_topk_prob=True))


def parameter_counts(path: str) -> tuple[int, int]:
    """(total, active per token) parameters of a checkpoint, from its safetensors headers."""
    import glob

    from safetensors import safe_open

    total = active = 0
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n
                active += n * TOP_K // NUM_EXPERTS if ".experts." in name else n
    return total, active


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    ap.add_argument("--num-seqs", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per engine; medians are compared")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        moe = make_moe_checkpoint(os.path.join(tmp, "qwen3-moe"))
        dense = make_checkpoint(os.path.join(tmp, "qwen3-dense"))
        (moe_total, moe_active), (dense_total, _) = parameter_counts(moe), parameter_counts(dense)
        prompts, outputs = workload(args.num_seqs, 8192, args.seed)
        warm = warmup_workload(args.num_seqs, 8192, args.seed)
        useful = sum(outputs)
        tp = args.tensor_parallel_size
        factories: dict[str, Callable[[], TidalRunner | HFRunner]] = {
            "tidal-moe": lambda: TidalRunner(moe, tp), "tidal-dense": lambda: TidalRunner(dense, tp)}
        if not args.skip_hf:
            factories["hf-moe"] = lambda: HFRunner(moe)
        timings = run_engines(factories, (prompts, outputs), args.repeats, warm)
    times = {name: [t["wall_s"] for t in runs] for name, runs in timings.items()}
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"workload: {args.num_seqs} seqs, prompt tokens {sum(map(len, prompts))}, output tokens {useful} "
          f"(U[16,256] / U[16,128], ignore_eos); timed runs of the engines alternate; tp={tp}")
    print(f"MoE: {NUM_EXPERTS} experts x {EXPERT_WIDTH}, top-{TOP_K}: {moe_total / 1e6:.1f}M parameters, "
          f"{moe_active / 1e6:.1f}M active per token; dense: {dense_total / 1e6:.1f}M")
    labels = {"tidal-moe": "tidal MoE", "tidal-dense": "tidal dense (same active size)",
              "hf-moe": "transformers MoE (left-padded batch)"}
    for name, ts in times.items():
        print(f"{labels[name]}: median {medians[name]:.2f} s, {useful / medians[name]:,.0f} output tokens/s  "
              f"(runs: {_runs(ts)} s)")
    if "hf-moe" in medians:
        print(f"ratio tidal MoE / transformers MoE: {medians['hf-moe'] / medians['tidal-moe']:.2f}x (medians); "
              f"per round: {_ratios(times['hf-moe'], times['tidal-moe'])}  (goal >= 3)")
    print(f"ratio tidal MoE / tidal dense tok/s: {medians['tidal-dense'] / medians['tidal-moe']:.2f} (medians); "
          f"per round: {_ratios(times['tidal-dense'], times['tidal-moe'])}  (goal >= 0.7)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
