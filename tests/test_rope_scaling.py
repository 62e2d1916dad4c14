"""Every RoPE scaling type against transformers' own rotary code: the cos/sin tables against
LlamaRotaryEmbedding, and whole models against transformers' generate (greedy, float32)."""
from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from tidal.worker.layers.rotary import ROPE_TYPES, RotaryEmbedding, rope_params_from_config

HEAD_DIM, MAX_POS, ORIGINAL, THETA = 16, 256, 64, 10000.0
HALF = HEAD_DIM // 2
SCALINGS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-deepseek": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                      "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
                 "short_factor": [1.0 + 0.05 * i for i in range(HALF)],
                 "long_factor": [1.5 + 0.4 * i for i in range(HALF)]},
}


def _hf_config(scaling: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM, num_hidden_layers=1,
                       max_position_embeddings=MAX_POS, rope_parameters={**scaling, "rope_theta": THETA})


def _hf_tables(scaling: dict[str, Any], num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cos and sin (first half of the head) for one forward over positions
    0..num_positions-1, the longest sequence of that pass deciding the dynamic types."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rope = LlamaRotaryEmbedding(_hf_config(scaling))
    x = torch.zeros(1, num_positions, HEAD_DIM)
    cos, sin = rope(x, torch.arange(num_positions)[None])
    return cos[0, :, :HALF], sin[0, :, :HALF]


def _ours(scaling: dict[str, Any], num_positions: int | None = None) -> RotaryEmbedding:
    cfg = _hf_config(scaling)
    theta, rope_scaling = rope_params_from_config(cfg)
    return RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, theta, rope_scaling, num_positions=num_positions)


def test_every_type_is_covered() -> None:
    assert {s["rope_type"] for s in SCALINGS.values()} == set(ROPE_TYPES)


@pytest.mark.parametrize("name", [n for n in SCALINGS if n not in ("dynamic", "longrope")])
def test_static_tables_match_transformers(name: str) -> None:
    ours = _ours(SCALINGS[name])
    cos, sin = _hf_tables(SCALINGS[name], MAX_POS)
    torch.testing.assert_close(ours.cos_cache, cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin_cache, sin, atol=1e-6, rtol=0)


def test_dynamic_ntk_is_transformers_at_the_longest_position_served() -> None:
    """transformers rescales once a sequence grows past max_position_embeddings; the engine
    evaluates it once, at the longest sequence it serves (as vLLM)."""
    for served in (MAX_POS, 2 * MAX_POS):
        ours = _ours(SCALINGS["dynamic"], num_positions=served)
        cos, sin = _hf_tables(SCALINGS["dynamic"], served)
        assert ours.cos_cache.shape[0] == served
        torch.testing.assert_close(ours.cos_cache, cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(ours.sin_cache, sin, atol=1e-6, rtol=0)


def test_longrope_short_factors_below_the_original_context_long_ones_after() -> None:
    ours = _ours(SCALINGS["longrope"])
    short_cos, short_sin = _hf_tables(SCALINGS["longrope"], ORIGINAL)  # transformers: all short
    long_cos, long_sin = _hf_tables(SCALINGS["longrope"], MAX_POS)  # past the original: all long
    torch.testing.assert_close(ours.cos_cache[:ORIGINAL], short_cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin_cache[:ORIGINAL], short_sin, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.cos_cache[ORIGINAL:], long_cos[ORIGINAL:], atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.sin_cache[ORIGINAL:], long_sin[ORIGINAL:], atol=1e-6, rtol=0)
    assert not torch.allclose(short_cos, long_cos[:ORIGINAL])  # the two sets differ: the test can fail


def test_unknown_type_is_refused_naming_the_supported_ones() -> None:
    with pytest.raises(NotImplementedError, match="rope_type 'mrope' is not supported.*yarn"):
        RotaryEmbedding(HEAD_DIM, HEAD_DIM, MAX_POS, THETA, {"rope_type": "mrope"})


# Whole models: transformers' generate keeps keys rotated as they were when cached, so a greedy
# run that starts below the original context and decodes past it checks longrope's switch too.
# dynamic is left out here: transformers leaves it unscaled below max_position_embeddings, the
# engine (as vLLM) uses the table of the longest sequence it serves.
MODEL_TYPES = ["linear", "yarn-deepseek", "llama3", "longrope"]


@pytest.fixture(scope="module")
def rope_models(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> dict[str, str]:
    from tidal.frontend.entrypoints.make_model import make_model

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        for i, name in enumerate(MODEL_TYPES):
            out[name] = make_model(str(tmp_path_factory.mktemp(name)), "llama", vocab_size=512, hidden_size=64,
                                   num_heads=4, num_kv_heads=2, num_layers=2, max_position_embeddings=MAX_POS,
                                   rope_theta=THETA, rope_scaling=SCALINGS[name], seed=i)
    return out


@pytest.mark.parametrize("name", MODEL_TYPES)
def test_greedy_matches_transformers_generate(rope_models: dict[str, str], name: str) -> None:
    from transformers import AutoModelForCausalLM

    from tidal import LLM, SamplingParams

    logging.getLogger("transformers").setLevel(logging.ERROR)
    path = rope_models[name]
    prompt = list(range(3, 3 + ORIGINAL - 8))  # 56 tokens: decoding crosses the original context
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False, min_new_tokens=40)
    expected = ref[0, len(prompt):].tolist()
    with LLM(path, dtype="float32", max_model_len=MAX_POS, multiprocessing=False) as llm:
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    assert out[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("scaling,positions", [
    (None, MAX_POS),
    ({"rope_type": "linear", "factor": 4.0}, 4 * MAX_POS),
    ({"rope_type": "dynamic", "factor": 2.0}, 2 * MAX_POS),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL}, 4 * ORIGINAL),
    ({"rope_type": "yarn", "factor": 4.0}, 4 * MAX_POS),
    (SCALINGS["llama3"], MAX_POS),  # llama3 and longrope configs state the extended length
    (SCALINGS["longrope"], MAX_POS),
])
def test_served_context_follows_vllms_rope_rule(scaling: dict[str, Any] | None, positions: int) -> None:
    from tidal.protocol.config import config_positions, model_positions

    raw = {"max_position_embeddings": MAX_POS, "rope_scaling": scaling}
    assert model_positions(raw) == positions
    assert config_positions(_hf_config(scaling or {"rope_type": "default"})) == positions  # transformers' config


def test_a_linear_scaled_model_serves_its_stretched_context(rope_models: dict[str, str]) -> None:
    from tidal import LLM, SamplingParams

    prompt = list(range(3, 3 + MAX_POS + 40))  # past max_position_embeddings, within 4x
    with LLM(rope_models["linear"], dtype="float32", multiprocessing=False) as llm:
        assert llm.llm_engine.model_config.max_model_len == 4 * MAX_POS
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(rope_models["linear"], dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False, min_new_tokens=4)
    assert out[0].outputs[0].token_ids == ref[0, len(prompt):].tolist()
