"""GPU offline throughput against the workload's physical floor (issue 14; scripts/device_check.sh).

Workload (nano-vllm's): random-weight Qwen3-0.6B from its real config (scripts/configs/qwen3-0.6b,
load_format="dummy", no tokenizer), 256 sequences, prompt and output lengths uniform on
[100, 1024] (seeded), temperature 0.6, ignore_eos, bf16, max_model_len 4096, all submitted at
once to tidal's LLM.generate. Measured in the same run: a device-to-device copy (bandwidth,
bytes read + written) and a bf16 N^3 matmul (FLOP/s). The floor (all sequences start together,
sequence i leaves after out_i tokens, as continuous batching runs it): each decode step
t = 1 .. max(out) - 1 reads the weights once and the KV of prompt_i + t tokens of every
sequence still running, over the bandwidth; prefill is 2 * matmul params * prompt tokens + the
LM head once per sequence + causal attention, over the matmul rate. floor_s is the sum (the
issue's definition; floor_roofline_s takes per decode step max(bytes, FLOPs) time);
efficiency = floor_s / wall. Also transformers `generate` and tidal on the first --hf-seqs
sequences, and tidal's model forward alone (forward_only: one decode step at batch 256, eager
and as a CUDA graph; the whole decode trajectory sampled every --stride steps; a prefill chunk)
to split kernel time from engine overhead. One JSON dict goes to --out, rewritten per phase.

    python scripts/device_bench.py --out bench.json             # on the GPU
    python scripts/device_bench.py --smoke --out /tmp/b.json    # tiny model on the CPU: checks this script
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any, Callable
from unittest import mock

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from device_floor import ceilings, floor_model, m_kv_block, model_numbers, sync, time_fn  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T0 = time.perf_counter()
RESULT: dict[str, Any] = {}


def save(path: str | None) -> None:
    if path:
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(RESULT, f, indent=1, default=str)
        os.replace(tmp, path)


def elapsed() -> float:
    return time.perf_counter() - T0


# ------------------------------------------------------------------ phases


def workload(n: int, lo: int, hi: int, olo: int, ohi: int, vocab: int, seed: int,
             first: int | None = None) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
    outputs = [rng.randint(olo, ohi) for _ in range(n)]
    if first is not None:  # warm-up prompts start with a token no timed prompt has: no cache hits
        prompts = [[first] + q[1:] for q in prompts]
    return prompts, outputs


def run_tidal(args: argparse.Namespace, model: str, prompts: list[list[int]], outputs: list[int],
              warm: tuple[list[list[int]], list[int]], hf_n: int, out: str | None) -> None:
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    def params(outs: list[int], base: int) -> list[SamplingParams]:
        return [SamplingParams(temperature=args.temperature, max_tokens=o, ignore_eos=True, seed=base + i)
                for i, o in enumerate(outs)]

    t = time.perf_counter()
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype=args.dtype, device=args.device,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager,
              gpu_memory_utilization=args.gpu_memory_utilization, seed=0)
    info: dict[str, Any] = {"startup_s": time.perf_counter() - t, "enforce_eager": args.enforce_eager}
    RESULT["tidal"] = info
    try:
        stats = llm.get_stats()
        info["kv_blocks"] = stats.num_total_blocks
        t = time.perf_counter()
        llm.generate([{"prompt_token_ids": q} for q in warm[0]], params(warm[1], 10**6), use_tqdm=False)
        info["warmup_s"] = time.perf_counter() - t

        def timed(ps: list[list[int]], outs: list[int]) -> dict[str, Any]:
            assert llm.reset_prefix_cache()
            s0, f0, n0 = llm.llm_engine.call_utility("get_timing")
            st0 = llm.get_stats()
            t0 = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": q} for q in ps], params(outs, 0), use_tqdm=False)
            wall = time.perf_counter() - t0
            s1, f1, n1 = llm.llm_engine.call_utility("get_timing")
            st1 = llm.get_stats()
            got = sum(len(r.outputs[0].token_ids) for r in res)
            assert got == sum(outs), (got, sum(outs))
            return {"wall_s": wall, "output_tokens": got, "output_tok_s": got / wall,
                    "total_tok_s": (got + sum(map(len, ps))) / wall, "steps": n1 - n0,
                    "step_s": s1 - s0, "forward_s": f1 - f0,
                    "mean_step_ms": 1e3 * (s1 - s0) / max(n1 - n0, 1),
                    "mean_forward_ms": 1e3 * (f1 - f0) / max(n1 - n0, 1),
                    "wall_per_step_ms": 1e3 * wall / max(n1 - n0, 1),
                    "preemptions": st1.num_preemptions - st0.num_preemptions,
                    "cached_prompt_tokens": sum(r.num_cached_tokens for r in res)}

        info.update(timed(prompts, outputs))
        save(out)
        print(f"[bench] tidal: {info['output_tok_s']:,.0f} output tok/s in {info['wall_s']:.2f} s", flush=True)
        if hf_n and elapsed() < args.budget_s - 60:
            RESULT["tidal_subset"] = timed(prompts[:hf_n], outputs[:hf_n])
    finally:
        llm.shutdown()


def forward_only(args: argparse.Namespace, model: str, cfg: dict[str, Any], prompts: list[list[int]],
                 outputs: list[int], dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """tidal's model forward + LM head alone, over a paged cache holding the first
    --forward-batch sequences whole (blocks shuffled): one decode step at batch B with contexts
    prompt_i + out_i // 2, eager and replayed as a CUDA graph (the issue's number); every
    --stride-th decode step of the workload's trajectory (live sequences, their contexts; as
    graphs when the capture works, as the engine runs decodes),
    summed x stride; one prefill chunk of max_num_batched_tokens, scaled to all prompt tokens.
    The last two add up to the kernel time of the workload, an engine with no overhead."""
    from tidal.worker.attention import Attention
    from tidal.worker.attention_metadata import AttentionMetadata
    from tidal.worker.forward_context import set_forward_context
    from tidal.worker.hf_config import load_hf_config
    from tidal.worker.loader import load_model

    bs, batch = 16, min(args.forward_batch, len(prompts))
    plen, olen = [len(q) for q in prompts[:batch]], outputs[:batch]
    nblk = [-(-(p + o) // bs) for p, o in zip(plen, olen)]
    total = sum(nblk) + 1
    if dev.type == "cuda":  # the engine core's process may still be handing its memory back
        need = total * m_kv_block(cfg, bs, dtype) + (4 << 30)
        deadline = time.perf_counter() + 30
        while torch.cuda.mem_get_info(dev)[0] < need and time.perf_counter() < deadline:
            time.sleep(0.5)
    model_ = load_model(model, load_hf_config(model), dtype, "dummy", dev, 0)
    layers = [m for m in model_.modules() if isinstance(m, Attention)]
    for layer in layers:
        shape = (total, bs, layer.num_kv_heads, layer.head_dim)
        layer.k_cache = torch.empty(shape, dtype=dtype, device=dev).normal_()
        layer.v_cache = torch.empty(shape, dtype=dtype, device=dev).normal_()
    ids = torch.randperm(total - 1, generator=torch.Generator().manual_seed(0)) + 1  # block 0: padding
    table = torch.zeros(batch, max(nblk), dtype=torch.long)
    k = 0
    for i, n in enumerate(nblk):
        table[i, :n] = ids[k:k + n]
        k += n

    def meta_for(rows: list[int], starts: list[int], ends: list[int]) -> AttentionMetadata:
        """Sequence rows[j] computes positions starts[j]..ends[j]-1 over its cached context."""
        pos = torch.cat([torch.arange(a, e) for a, e in zip(starts, ends)])
        seq = torch.cat([torch.full((e - a,), r) for r, a, e in zip(rows, starts, ends)])
        slots = table[seq, pos // bs] * bs + pos % bs
        qsl = [0]
        for a, e in zip(starts, ends):
            qsl.append(qsl[-1] + e - a)
        return AttentionMetadata.build(  # device copies given: nothing is made from lists inside a capture
            slots.to(dev), qsl, list(ends), table[rows].to(dev), bs,
            query_start_loc_device=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens_device=torch.tensor(ends, dtype=torch.int32, device=dev)), pos.to(dev)

    def timed_step(meta: AttentionMetadata, positions: torch.Tensor, iters: int, warmup: int,
                   graph: bool = False) -> float:
        """Median seconds of forward + LM head (on each sequence's last token); graph: captured
        once (after an eager warm-up) and replayed."""
        tokens = torch.randint(10, cfg["vocab_size"], (positions.numel(),), device=dev)
        last = torch.tensor(meta.query_start_loc[1:], device=dev) - 1
        def fn() -> torch.Tensor:
            return model_.compute_logits(model_(tokens, positions)[last])

        with set_forward_context(meta):
            if not graph:
                return time_fn(fn, dev, iters, warmup)
            fn()
            torch.cuda.synchronize(dev)
            g = torch.cuda.CUDAGraph()
            # torch.cuda.graph collects garbage and empties the cache at each capture: skipped
            # (as the engine's capture does), dozens of captures follow
            with mock.patch("gc.collect", lambda *a, **k: 0), mock.patch("torch.cuda.empty_cache", lambda: None), \
                    torch.cuda.graph(g):
                fn()
            return time_fn(g.replay, dev, iters, 1)

    res: dict[str, Any] = {"batch": batch}
    rows = list(range(batch))
    mid = [p + o // 2 for p, o in zip(plen, olen)]
    res["mean_context"] = sum(mid) / batch
    cuda = dev.type == "cuda"
    with torch.inference_mode():
        meta, positions = meta_for(rows, [c - 1 for c in mid], mid)
        res["eager_ms"] = 1e3 * timed_step(meta, positions, 10, 3)
        if cuda:
            try:
                res["graph_ms"] = 1e3 * timed_step(meta, positions, 20, 0, graph=True)
            except Exception as e:  # noqa: BLE001 - reported; the trajectory then runs eagerly
                res["graph_error"] = f"{type(e).__name__}: {e}"[:300]
        use_graph = cuda and "graph_ms" in res  # as the engine runs decode steps
        res["trajectory_graphs"] = use_graph
        # the decode trajectory (all start together; sequence i leaves after out_i tokens)
        stride, est = args.stride, 0.0
        for t in range(1, max(olen), stride):
            live = [i for i in rows if olen[i] > t]
            meta, positions = meta_for(live, [plen[i] + t - 1 for i in live], [plen[i] + t for i in live])
            est += timed_step(meta, positions, 3, 1, use_graph) * min(stride, max(olen) - t)
        res["decode_trajectory_s"] = est * len(prompts) / batch  # scaled when batch < num_seqs
        # one prefill chunk of whole prompts, scaled to every prompt token of the workload
        chunk, n = [], 0
        for i in rows:
            if n + plen[i] > args.max_num_batched_tokens and chunk:
                break
            chunk.append(i)
            n += plen[i]
        meta, positions = meta_for(chunk, [0] * len(chunk), [plen[i] for i in chunk])
        res["prefill_chunk_tokens"] = n
        res["prefill_chunk_ms"] = 1e3 * timed_step(meta, positions, 3, 1)
        res["prefill_s"] = res["prefill_chunk_ms"] / 1e3 * sum(len(q) for q in prompts) / n
        res["kernel_time_s"] = res["decode_trajectory_s"] + res["prefill_s"]
    for layer in layers:
        layer.k_cache = layer.v_cache = torch.empty(0)
    return res


def run_hf(args: argparse.Namespace, model: str, prompts: list[list[int]], outputs: list[int],
           dev: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """transformers generate, left-padded batch, max_new_tokens = the longest request (every
    row runs that long); only the tokens each request asked for count as useful."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model)
    with torch.device(dev):
        hf = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()

    def gen(ps: list[list[int]], new: int, max_time: float | None = None) -> tuple[float, int]:
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(q)) + q for q in ps], device=dev)
        mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in ps], device=dev)
        sync(dev)
        t = time.perf_counter()
        with torch.inference_mode():
            o = hf.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=args.temperature,
                            top_k=0, top_p=1.0, max_new_tokens=new, min_new_tokens=new, pad_token_id=0,
                            max_time=max_time)
        sync(dev)
        return time.perf_counter() - t, o.shape[1] - width

    gen([q[:16] for q in prompts[:2]], 8)  # warm-up
    # max_time: stop in the bench's budget; then only the tokens made so far count
    wall, made = gen(prompts, max(outputs), max(10.0, args.budget_s - elapsed() - 5))
    useful = sum(min(o, made) for o in outputs)
    return {"seqs": len(prompts), "wall_s": wall, "useful_output_tokens": useful, "steps": made,
            "cut_at_budget": made < max(outputs), "output_tok_s": useful / wall,
            "padded_output_tok_s": len(prompts) * made / wall}


# ------------------------------------------------------------------ main


def smoke_config(path: str) -> dict[str, Any]:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               intermediate_size=128, vocab_size=512, max_window_layers=2, bos_token_id=1, eos_token_id=2)
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(ROOT, "scripts", "configs", "qwen3-0.6b"),
                    help="a directory holding a config.json (weights are dummy)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=(100, 1024), metavar=("MIN", "MAX"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.6)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--warmup-seqs", type=int, default=32)
    ap.add_argument("--warmup-output", type=int, default=32)
    ap.add_argument("--hf-seqs", type=int, default=32, help="0: no transformers run")
    ap.add_argument("--forward-batch", type=int, default=256, help="0: no forward-only timing")
    ap.add_argument("--stride", type=int, default=16, help="forward-only: time every stride-th decode step")
    ap.add_argument("--copy-mb", type=int, default=2048)
    ap.add_argument("--matmul-n", type=int, default=8192)
    ap.add_argument("--budget-s", type=float, default=170.0,
                    help="optional phases (subset, forward-only, transformers) are skipped past this")
    ap.add_argument("--smoke", action="store_true", help="tiny model, tiny workload, CPU: checks this script")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="tidal-bench-")
    model = args.config
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    if args.smoke:
        cfg = smoke_config(model)
        model = os.path.join(tmp, "smoke-model")
        os.makedirs(model)
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(cfg, f)
        if args.device == "cuda" and not torch.cuda.is_available():
            args.device = "cpu"
        args.num_seqs, args.input_len, args.output_len = 8, (8, 40), (4, 24)
        args.max_model_len, args.max_num_batched_tokens, args.max_num_seqs = 256, 128, 16
        args.warmup_seqs, args.warmup_output, args.hf_seqs, args.forward_batch, args.stride = 4, 4, 4, 8, 4
        args.copy_mb, args.matmul_n = 64, 256
    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    RESULT["args"] = vars(args)
    RESULT["env"] = {"torch": torch.__version__, "python": sys.version.split()[0],
                     "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}
    try:
        import triton

        RESULT["env"]["triton"] = triton.__version__
    except ImportError:
        RESULT["env"]["triton"] = None
    m = model_numbers(cfg, torch.empty((), dtype=dtype).element_size())
    RESULT["model"] = m
    prompts, outputs = workload(args.num_seqs, *args.input_len, *args.output_len, cfg["vocab_size"], args.seed)
    warm = workload(args.warmup_seqs, *args.input_len, args.warmup_output, args.warmup_output,
                    cfg["vocab_size"], args.seed + 1, first=3)
    RESULT["workload"] = {"num_seqs": args.num_seqs, "prompt_tokens": sum(map(len, prompts)),
                          "output_tokens": sum(outputs), "max_output": max(outputs)}
    errors: dict[str, str] = {}
    RESULT["errors"] = errors

    def phase(name: str, fn: Callable[[], Any], need_s: float = 0.0) -> None:
        if need_s and elapsed() > args.budget_s - need_s:
            RESULT[name] = {"skipped": f"budget: {elapsed():.0f} s of {args.budget_s:.0f} s used"}
        else:
            print(f"[bench] {name} (t={elapsed():.0f} s)", flush=True)
            try:
                r = fn()
                if r is not None:
                    RESULT[name] = r
            except Exception as e:  # noqa: BLE001 - one broken phase must not hide the others
                traceback.print_exc()
                errors[name] = f"{type(e).__name__}: {e}"[:2000]
            gc.collect()  # the phase's tensors (models, caches) go before the next phase
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        save(args.out)

    phase("ceilings", lambda: ceilings(dev, args.copy_mb, args.matmul_n, dtype))
    if "ceilings" in RESULT:
        c = RESULT["ceilings"]
        RESULT["floor"] = floor_model(list(map(len, prompts)), outputs, m, c["bandwidth_Bps"], c["matmul_flops"])
        save(args.out)
    hf_n = min(args.hf_seqs, args.num_seqs)
    phase("tidal", lambda: run_tidal(args, model, prompts, outputs, warm, hf_n, args.out))
    if args.forward_batch:
        phase("forward_only", lambda: forward_only(args, model, cfg, prompts, outputs, dev, dtype), need_s=20)
    if hf_n:
        phase("transformers", lambda: run_hf(args, model, prompts[:hf_n], outputs[:hf_n], dev, dtype), need_s=30)
    summarize()
    save(args.out)
    print(json.dumps(RESULT.get("summary", {}), indent=1, default=str))


def summarize() -> None:
    s: dict[str, Any] = {}
    tid, fl, c = RESULT.get("tidal", {}), RESULT.get("floor"), RESULT.get("ceilings", {})
    if c:
        s["bandwidth_TBps"] = c["bandwidth_Bps"] / 1e12
        s["matmul_TFLOPs"] = c["matmul_flops"] / 1e12
    if fl:
        s["floor_s"], s["floor_output_tok_s"] = fl["floor_s"], fl["floor_output_tok_s"]
    if "output_tok_s" in tid:
        s["tidal_output_tok_s"], s["tidal_wall_s"] = tid["output_tok_s"], tid["wall_s"]
        s["tidal_mean_step_ms"] = tid["mean_step_ms"]
        if fl:
            s["efficiency"] = float(fl["floor_s"] / tid["wall_s"])
            s["efficiency_roofline"] = float(fl["floor_roofline_s"] / tid["wall_s"])
            s["bar_40pct_met"] = bool(s["efficiency"] >= 0.4)
            s["goal_70pct_met"] = bool(s["efficiency"] >= 0.7)
    fo = RESULT.get("forward_only", {})
    if "eager_ms" in fo:
        s["forward_only_eager_ms"] = fo["eager_ms"]
        s["forward_only_graph_ms"] = fo.get("graph_ms")
        m, c2 = RESULT["model"], RESULT.get("ceilings")
        if c2:
            step_floor = (m["weight_bytes_per_step"] + m["kv_bytes_per_token"] * fo["mean_context"] * fo["batch"]) \
                / c2["bandwidth_Bps"]
            s["forward_only_floor_ms"] = 1e3 * step_floor
        if "kernel_time_s" in fo:
            s["kernel_time_s"] = fo["kernel_time_s"]
            if "wall_s" in tid:
                s["engine_overhead_share"] = 1 - fo["kernel_time_s"] / tid["wall_s"]
            if fl:
                s["kernel_efficiency"] = float(fl["floor_s"] / fo["kernel_time_s"])
    hf, sub = RESULT.get("transformers", {}), RESULT.get("tidal_subset", {})
    if "output_tok_s" in hf:
        s["hf_output_tok_s"] = hf["output_tok_s"]
        if "output_tok_s" in sub:
            s["tidal_subset_output_tok_s"] = sub["output_tok_s"]
            s["ratio_tidal_over_hf_same_seqs"] = sub["output_tok_s"] / hf["output_tok_s"]
    s["errors"] = sorted(RESULT.get("errors", {}))
    s["elapsed_s"] = elapsed()
    RESULT["summary"] = s


if __name__ == "__main__":
    main()
