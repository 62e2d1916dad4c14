"""Phi-3 (fused qkv / gate-up checkpoint tensors, LongRoPE "su", partial rotary as Phi-4-mini,
sliding window) against transformers in float32: tests/test_models.py's method (same checkpoint,
paged KV cache), the whole engine through LLM.generate, and the published config on meta."""

from __future__ import annotations

import json
import os
import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tidal.protocol.sliding_window import kv_sliding_window, layer_sliding_windows
from tidal.worker.layers.rotary import RotaryEmbedding, rope_params_from_config, rotary_dim_from_config
from tidal.worker.loader import load_model

try:
    import test_models as tm
except ImportError:  # tests/ made a package
    import tests.test_models as tm  # type: ignore[no-redef]

ATOL, Loaded, hf_logits, rand_tokens = tm.ATOL, tm.Loaded, tm.hf_logits, tm.rand_tokens

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_POS, ORIGINAL, HEAD_DIM = 256, 64, 16
ROTARY = 12  # HEAD_DIM x 0.75, Phi-4-mini's partial_rotary_factor
LONGROPE = {"type": "su", "original_max_position_embeddings": ORIGINAL,  # Phi-3-128k's older spelling
            "short_factor": [1.0 + 0.05 * i for i in range(ROTARY // 2)],
            "long_factor": [1.5 + 0.4 * i for i in range(ROTARY // 2)]}

# name -> (arch, make_model kwargs, block_size)
CONFIGS: dict[str, tuple[str, dict[str, Any], int]] = {
    # Phi-3-mini's shape: multi-head (kv heads == heads), untied, full rotary
    "phi3-mha": ("phi3", dict(num_heads=4, num_kv_heads=4), 4),
    # Phi-4-mini's: GQA 6/2, tied embeddings, partial rotary 0.75, LongRoPE ("su") over a 64-token
    # pre-training context stretched to 256
    "phi3-longrope": ("phi3", dict(hidden_size=96, num_heads=6, num_kv_heads=2, head_dim=HEAD_DIM,
                                   tie_word_embeddings=True, max_position_embeddings=MAX_POS,
                                   rope_scaling=dict(LONGROPE),  # a copy: Phi3Config edits it
                                   config_overrides=dict(partial_rotary_factor=0.75)), 16),
    # Phi-3-mini-4k's sliding window (2047 there), shorter than the test prompts
    "phi3-window": ("phi3", dict(num_layers=3, sliding_window=8), 4),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> dict[str, Loaded]:
    return tm.load_configs(CONFIGS, tmp_path_factory, tidal_cache_dir)


def test_checkpoints_hold_fused_tensors_and_the_configs_what_they_claim(models: dict[str, Loaded]) -> None:
    """The test checkpoints are Phi-3's layout: qkv_proj and gate_up_proj fused, no split names."""
    for name, m in models.items():
        with safe_open(os.path.join(m.path, "model.safetensors"), "pt") as f:
            keys = set(f.keys())
        assert "model.layers.0.self_attn.qkv_proj.weight" in keys and "model.layers.0.mlp.gate_up_proj.weight" in keys
        assert not any(k.endswith(("q_proj.weight", "gate_proj.weight", "up_proj.weight")) and "qkv" not in k
                       and "gate_up" not in k for k in keys), name
    rope = models["phi3-longrope"].model.model.rotary_emb
    assert (rope.rope_type, rope.rotary_dim, rope.head_size) == ("longrope", ROTARY, HEAD_DIM)
    assert {layer.self_attn.attn.sliding_window for layer in models["phi3-window"].model.model.layers} == {8}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match(models: dict[str, Loaded], name: str) -> None:
    tm.assert_prefill_logits_match(models[name])  # 23 and 9 tokens: below ORIGINAL, past the window


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_hf_generate(models: dict[str, Loaded], name: str) -> None:
    tm.assert_greedy_matches_hf_generate(models[name], 20)


def _hf_greedy_token_by_token(hf: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' model decoding one token per forward over its own cache: keys keep the
    rotation they were cached with, each step's frequencies chosen by its position (long
    factors from ORIGINAL on). HF's Phi3 generate() instead drops the cache when a sequence
    first passes original_max_position_embeddings and recomputes every key with long factors;
    tidal, like vLLM, never re-rotates cached keys."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True)
        tokens = [int(out.logits[0, -1].argmax())]
        for _ in range(new_tokens - 1):
            out = hf(torch.tensor([tokens[-1:]]), cache=out.cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def test_longrope_decoding_across_the_original_context(models: dict[str, Loaded]) -> None:
    """A prompt just below original_max_position_embeddings decoded 24 tokens past it, through
    the paged cache: short factors below ORIGINAL, long ones from there on."""
    m = models["phi3-longrope"]
    prompt = rand_tokens(ORIGINAL - 8, m.vocab_size, 7)
    expected = _hf_greedy_token_by_token(m.hf, prompt, 32)
    kv = tm.PagedKV(m.model, m.block_size)
    tokens = list(prompt)
    try:
        logits = kv.step([(0, prompt, 0)])
        for _ in range(32):
            tokens.append(int(logits[-1].argmax()))
            logits = kv.step([(0, tokens[-1:], len(tokens) - 1)])
    finally:
        kv.release()
    assert tokens[len(prompt):] == expected
    # The switch is real: transformers with every position on the long factors disagrees.
    long_only = hf_logits(m.hf, tokens[: ORIGINAL + 4])[: len(prompt)]
    assert not torch.allclose(long_only, hf_logits(m.hf, prompt), atol=1e-2)


def test_llm_generate_greedy_matches_hf(models: dict[str, Loaded], tidal_cache_dir: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine (scheduler, model runner, sampler) on Phi-3 checkpoints, batched: the
    plain one against generate(), the LongRoPE one decoding across its original context."""
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    monkeypatch.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
    m = models["phi3-mha"]
    prompts = [rand_tokens(n, m.vocab_size, 20 + n) for n in (5, 13, 9)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    with LLM(model=m.path, dtype="float32", device="cpu", multiprocessing=False, max_model_len=64,
             num_kv_blocks=64) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = m.hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                                pad_token_id=0)
        assert list(out.outputs[0].token_ids) == ref[0, len(prompt):].tolist()

    m = models["phi3-longrope"]
    prompts = [rand_tokens(ORIGINAL - n, m.vocab_size, 30 + n) for n in (6, 11)]
    with LLM(model=m.path, dtype="float32", device="cpu", multiprocessing=False, max_model_len=128,
             num_kv_blocks=32) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.outputs[0].token_ids) == _hf_greedy_token_by_token(m.hf, prompt, 20)


def test_su_scaling_in_config_json_loads_as_longrope(models: dict[str, Loaded], tmp_path: Any) -> None:
    """A config.json in the older spelling (rope_scaling {"type": "su"}, rope_theta and
    partial_rotary_factor at the top level) reads as the longrope model transformers builds
    from it. (transformers 5 wants original_max_position_embeddings inside an "su" dict too.)"""
    from transformers import AutoConfig

    m = models["phi3-longrope"]
    path = str(tmp_path / "su")
    shutil.copytree(m.path, path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.pop("rope_parameters", None)
    cfg.update(rope_theta=10000.0, partial_rotary_factor=0.75, rope_scaling=dict(LONGROPE))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    auto = AutoConfig.from_pretrained(path)
    assert auto.rope_parameters["rope_type"] == "longrope"
    model = load_model(path, auto, torch.float32)
    tokens = rand_tokens(30, m.vocab_size, 3)
    with torch.no_grad():
        got = model.compute_logits(model(torch.tensor(tokens), torch.arange(len(tokens))))
    torch.testing.assert_close(got, hf_logits(m.hf, tokens), atol=ATOL, rtol=0)

    # The same fields read without transformers: "su" is longrope, the rotary part 0.75.
    plain = SimpleNamespace(**cfg)
    theta, scaling = rope_params_from_config(plain)
    assert theta == 10000.0 and scaling is not None and scaling["rope_type"] == "longrope" and "type" not in scaling
    assert rotary_dim_from_config(plain, HEAD_DIM) == ROTARY
    assert rotary_dim_from_config(auto, HEAD_DIM) == ROTARY


def test_partial_rotary_matches_transformers() -> None:
    """RotaryEmbedding with rotary_dim < head_size: transformers' apply_rotary_pos_emb (the first
    rotary_dim dims of each head rotate, the rest pass), default and longrope tables."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    heads, positions = 3, torch.tensor([0, 5, 17, 63, 64, 200])
    for scaling in (None, LONGROPE):
        cfg = Phi3Config(hidden_size=heads * HEAD_DIM, num_attention_heads=heads, max_position_embeddings=MAX_POS,
                         original_max_position_embeddings=ORIGINAL, partial_rotary_factor=0.75,
                         rope_scaling=dict(scaling) if scaling else None)
        theta, rope_scaling = rope_params_from_config(cfg)
        ours = RotaryEmbedding(HEAD_DIM, rotary_dim_from_config(cfg, HEAD_DIM), MAX_POS, theta, rope_scaling,
                               ORIGINAL)
        g = torch.Generator().manual_seed(0)
        q, k = torch.randn(len(positions), heads, HEAD_DIM, generator=g), torch.randn(len(positions), heads, HEAD_DIM,
                                                                                   generator=g)
        got_q, got_k = ours(positions, q.clone(), k.clone())
        hf_rope = Phi3RotaryEmbedding(cfg)
        for i, pos in enumerate(positions.tolist()):
            # transformers' table for a sequence of pos + 1 tokens (short below ORIGINAL, long after)
            cos, sin = hf_rope(q, torch.arange(pos + 1)[None])
            want_q, want_k = apply_rotary_pos_emb(q[i][None, :, None], k[i][None, :, None], cos[:, pos:pos + 1],
                                                  sin[:, pos:pos + 1])
            torch.testing.assert_close(got_q[i], want_q[0, :, 0], atol=1e-6, rtol=0)
            torch.testing.assert_close(got_k[i], want_k[0, :, 0], atol=1e-6, rtol=0)
        assert torch.equal(got_q[..., ROTARY:], q[..., ROTARY:])  # the pass-through part untouched
    with pytest.raises(ValueError, match="rotary_dim"):
        RotaryEmbedding(HEAD_DIM, 7, MAX_POS, 10000.0)


def test_sliding_window_rule() -> None:
    """Every Phi-3 layer slides when sliding_window is set (transformers 5's Phi3Model uses the
    sliding mask on all layers), by architecture or by model_type alone; None: full."""
    for named in (dict(architectures=["Phi3ForCausalLM"]), dict(model_type="phi3")):
        cfg = SimpleNamespace(num_hidden_layers=3, sliding_window=2047, **named)
        assert layer_sliding_windows(cfg) == [2047] * 3 and kv_sliding_window(cfg) == 2047
        assert layer_sliding_windows(SimpleNamespace(num_hidden_layers=3, sliding_window=None, **named)) == [None] * 3


def test_published_config_builds_with_its_size() -> None:
    """scripts/configs/phi-3-mini-4k-instruct builds on the meta device with the model card's
    3.8B parameters (3,821,079,552), every layer sliding over 2047 positions."""
    from transformers import AutoConfig

    from tidal.protocol.sliding_window import model_kv_sliding_window
    from tidal.worker.models.registry import get_model_class

    path = os.path.join(ROOT, "scripts", "configs", "phi-3-mini-4k-instruct")
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg)
    assert type(model).__name__ == "Phi3ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) == 3_821_079_552
    assert model_kv_sliding_window(path) == 2047
    assert {layer.self_attn.attn.sliding_window for layer in model.model.layers} == {2047}
