"""Mixture-of-experts: the fused MoE layer against a per-token reference, and Qwen3-MoE / Mixtral
against transformers in float32 (tests/test_models.py's method: same checkpoint, paged KV)."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tidal.frontend.entrypoints.make_model import make_model
from tidal.worker.layers.fused_moe import FusedMoE
from tidal.worker.layers.gemm import half_storage_enabled
from tidal.worker.loader import load_model

try:
    import test_models as tm
    from test_models import torch_ops_only  # noqa: F401 - a fixture, requested by name
except ImportError:  # tests/ made a package
    import tests.test_models as tm  # type: ignore[no-redef]
    from tests.test_models import torch_ops_only  # type: ignore[no-redef]  # noqa: F401

ATOL, Loaded, hf_logits, rand_tokens = tm.ATOL, tm.Loaded, tm.hf_logits, tm.rand_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# name -> (arch, make_model kwargs, block_size)
CONFIGS: dict[str, tuple[str, dict[str, Any], int]] = {
    # renormalized top-2 of 8, a dense layer in the middle (mlp_only_layers), tied embeddings
    "qwen3_moe-norm": ("qwen3_moe", dict(num_layers=3, moe_intermediate_size=48,
                                         config_overrides=dict(norm_topk_prob=True, mlp_only_layers=[1])), 4),
    # raw softmax weights (norm_topk_prob off), top-3 of 4, MoE on every 2nd layer, untied, GQA 8/2
    "qwen3_moe-step2": ("qwen3_moe", dict(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16, num_experts=4,
                                          num_experts_per_tok=3, tie_word_embeddings=False, max_shard_size="80KB",
                                          config_overrides=dict(norm_topk_prob=False, decoder_sparse_step=2)), 16),
    # Mixtral: softmax over the top-2 of 4, every layer MoE
    "mixtral": ("mixtral", dict(num_experts=4, intermediate_size=96), 4),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> dict[str, Loaded]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        return tm.load_configs(CONFIGS, tmp_path_factory)


# ------------------------------------------------------------------ the layer


def per_token_reference(x: torch.Tensor, logits: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                        down: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
    """Straight from the definition, one token at a time: gate/up [E, I, H], down [E, H, I]."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), dim=-1)
        chosen = sorted(range(len(probs)), key=lambda e: -float(probs[e]))[:top_k]
        total = sum(float(probs[e]) for e in chosen) if renormalize else 1.0
        for e in chosen:
            h = F.silu(gate[e] @ x[t]) * (up[e] @ x[t])
            out[t] += float(probs[e]) / total * (down[e] @ h)
    return out


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_per_token_reference(kernels: bool, renormalize: bool,
                                               request: pytest.FixtureRequest) -> None:
    if not kernels:
        request.getfixturevalue("torch_ops_only")
    e, k, h, i, t = 6, 2, 32, 24, 37
    g = torch.Generator().manual_seed(0)
    gate, up, down = (0.2 * torch.randn(shape, generator=g) for shape in ((e, i, h), (e, i, h), (e, h, i)))
    # 37 tokens, most experts hit several times, one expert (5) never: its logit is far below
    x, logits = torch.randn(t, h, generator=g), torch.randn(t, e, generator=g)
    logits[:, 5] = -30.0
    moe = FusedMoE(e, k, h, i, renormalize)
    for ex in range(e):  # the HF hub layout: one tensor per expert and projection
        moe.w13_weight.weight_loader(moe.w13_weight, gate[ex], ("w1", ex))
        moe.w13_weight.weight_loader(moe.w13_weight, up[ex], ("w3", ex))
        moe.w2_weight.weight_loader(moe.w2_weight, down[ex], ("w2", ex))
    moe.process_weights_after_loading()
    want = per_token_reference(x, logits, gate, up, down, k, renormalize)
    with torch.no_grad():
        got = moe(x, logits)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        # A token's output does not depend on the batch around it (one row alone, a decode).
        torch.testing.assert_close(moe(x[7:8], logits[7:8]), got[7:8], atol=1e-6, rtol=1e-5)
        assert moe(x[:0], logits[:0]).shape == (0, h)


def test_fused_moe_stacked_checkpoint_loads_like_per_expert() -> None:
    """transformers 5's stacked tensors (gate_up_proj [E, 2I, H], down_proj [E, H, I], shard
    id None) load into the same parameters as the hub's per-expert ones; wrong shapes fail."""
    e, h, i = 3, 16, 8
    g = torch.Generator().manual_seed(1)
    gate_up, down = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
    stacked = FusedMoE(e, 2, h, i, renormalize=True)
    stacked.w13_weight.weight_loader(stacked.w13_weight, gate_up)
    stacked.w2_weight.weight_loader(stacked.w2_weight, down)
    assert torch.equal(stacked.w13_weight, gate_up) and torch.equal(stacked.w2_weight, down)
    with pytest.raises(ValueError, match="shape"):
        stacked.w13_weight.weight_loader(stacked.w13_weight, gate_up[:, :i])
    with pytest.raises(ValueError, match="shape"):  # a down tensor given as a gate one
        stacked.w13_weight.weight_loader(stacked.w13_weight, down[0], ("w1", 0))
    with pytest.raises(ValueError, match="expert 3"):
        stacked.w13_weight.weight_loader(stacked.w13_weight, gate_up[0, :i], ("w1", 3))
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        FusedMoE(e, 4, h, i, renormalize=True)


# ------------------------------------------------------------------ the models


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match(models: dict[str, Loaded], name: str) -> None:
    tm.assert_prefill_logits_match(models[name])


@pytest.mark.parametrize("name,kernels", [(n, True) for n in CONFIGS] + [("qwen3_moe-norm", False)])
def test_greedy_matches_hf_generate(models: dict[str, Loaded], name: str, kernels: bool,
                                    request: pytest.FixtureRequest) -> None:
    if not kernels:
        request.getfixturevalue("torch_ops_only")
    tm.assert_greedy_matches_hf_generate(models[name], 20)


def _stack_experts(src: str, dst: str) -> None:
    """Rewrite a checkpoint's per-expert tensors as transformers 5 holds them in memory:
    `mlp.experts.gate_up_proj` [E, 2I, H] and `mlp.experts.down_proj` [E, H, I] per layer."""
    import shutil

    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "model.safetensors"))
    weights = load_file(os.path.join(src, "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    layers: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for name, w in weights.items():
        parts = name.replace(".block_sparse_moe.", ".mlp.").split(".experts.")
        if len(parts) == 1:
            out[name] = w
            continue
        expert, proj = parts[1].split(".")[:2]
        layers.setdefault(parts[0], {}).setdefault(proj, {})[int(expert)] = w
    for prefix, projs in layers.items():
        gate = projs.get("gate_proj") or projs["w1"]
        up = projs.get("up_proj") or projs["w3"]
        down = projs.get("down_proj") or projs["w2"]
        n = len(gate)
        out[f"{prefix}.experts.gate_up_proj"] = torch.stack([torch.cat([gate[e], up[e]]) for e in range(n)])
        out[f"{prefix}.experts.down_proj"] = torch.stack([down[e] for e in range(n)])
    save_file(out, os.path.join(dst, "model.safetensors"))


@pytest.mark.parametrize("name", ["qwen3_moe-norm", "mixtral"])
def test_stacked_expert_checkpoint_matches_hf(models: dict[str, Loaded], name: str, tmp_path: Any) -> None:
    from transformers import AutoConfig

    m = models[name]
    path = str(tmp_path / "stacked")
    _stack_experts(m.path, path)
    model = load_model(path, AutoConfig.from_pretrained(path), torch.float32)
    tokens = rand_tokens(11, m.vocab_size, 3)
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
    torch.testing.assert_close(got, hf_logits(m.hf, tokens), atol=ATOL, rtol=0)


def test_bfloat16_as_close_to_float32_as_transformers_bfloat16(models: dict[str, Loaded]) -> None:
    """Half weights: each expert packed for the half GEMM (CPU), float32 compute."""
    from transformers import AutoConfig

    m = models["qwen3_moe-norm"]
    ours = load_model(m.path, AutoConfig.from_pretrained(m.path), torch.bfloat16)
    if half_storage_enabled(torch.bfloat16, "cpu"):
        experts = [mod for mod in ours.modules() if isinstance(mod, FusedMoE)]
        assert experts and all(mod.w13_weight is None and mod.packed_w13[0] is not None for mod in experts)
    tm.assert_bfloat16_as_close_as_transformers(m, ours)


@pytest.mark.parametrize("field,value", [("shared_expert_intermediate_size", 64), ("hidden_act", "gelu"),
                                         ("scoring_func", "sigmoid")])
def test_config_fields_that_change_the_output_are_refused(models: dict[str, Loaded], field: str,
                                                          value: Any) -> None:
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(models["qwen3_moe-norm"].path)
    setattr(cfg, field, value)
    with pytest.raises(ValueError, match=field):
        load_model(models["qwen3_moe-norm"].path, cfg, torch.float32, load_format="dummy")


def test_tensor_parallel_2_matches_hf(tmp_path: Any, tidal_cache_dir: str) -> None:
    """TP=2 over gloo: every expert's intermediate dimension split in two, the router
    replicated, a dense layer among the MoE ones, odd vocabulary (padded LM head)."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        path = make_model(str(tmp_path / "m"), "qwen3_moe", vocab_size=515, num_layers=3, moe_intermediate_size=48,
                          tie_word_embeddings=False,
                          config_overrides=dict(norm_topk_prob=True, mlp_only_layers=[0]))
    out_file = str(tmp_path / "out.pt")
    mp.start_processes(tm._tp_worker, args=(2, str(tmp_path / "init"), path, out_file), nprocs=2, start_method="spawn")
    res = torch.load(out_file)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ra, rb = hf_logits(hf, res["a"]), hf_logits(hf, res["b"])
    torch.testing.assert_close(res["first"], torch.cat([ra[:9], rb[:5]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(res["second"], torch.cat([rb[5:], ra[9:]]), atol=ATOL, rtol=0)


def test_llm_generate_greedy_matches_hf(models: dict[str, Loaded], tidal_cache_dir: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine (scheduler, model runner, sampler) on a Qwen3-MoE checkpoint."""
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    monkeypatch.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)  # the tokenizer's verdict, not the user's cache
    m = models["qwen3_moe-norm"]
    prompts = [rand_tokens(n, m.vocab_size, 20 + n) for n in (5, 13, 9)]
    with LLM(model=m.path, dtype="float32", device="cpu", multiprocessing=False, max_model_len=64,
             num_kv_blocks=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = m.hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt):].tolist()


# ------------------------------------------------------------------ real configs, dummy weights

# Published sizes (model cards): total and active parameters.
REAL_CONFIGS = {"qwen3-30b-a3b": (30.5e9, 3.3e9), "mixtral-8x7b": (46.7e9, 12.9e9)}


@pytest.mark.parametrize("name", list(REAL_CONFIGS))
def test_real_configs_build_with_their_published_size(name: str) -> None:
    """scripts/configs/<name> builds (on the meta device: no memory) with as many parameters as
    the model card says, total and per token."""
    from transformers import AutoConfig

    from tidal.worker.models.registry import get_model_class

    cfg = AutoConfig.from_pretrained(os.path.join(ROOT, "scripts", "configs", name))
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for mod in model.modules() if isinstance(mod, FusedMoE) for p in mod.parameters())
    moe = next(mod for mod in model.modules() if isinstance(mod, FusedMoE))
    active = total - experts + experts * moe.top_k // moe.num_experts
    want_total, want_active = REAL_CONFIGS[name]
    assert abs(total - want_total) < 0.02 * want_total, total
    assert abs(active - want_active) < 0.04 * want_active, active
    with open(os.path.join(ROOT, "scripts", "configs", name, "config.json")) as f:
        assert json.load(f)["architectures"] == [type(model).__name__]
