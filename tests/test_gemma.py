"""Gemma 2 and Gemma 3 (text) against transformers in float32, and attention logit soft-capping
in every attention backend against a float64 reference written from the definition.

The checkpoints are small random ones made here with transformers (norm weights random too, so
the 1 + weight convention matters), with both soft-caps on and a sliding window (8) shorter
than every prompt + output, so local and global layers both decide the tokens. transformers 5's
Gemma 3 attention drops attn_logit_softcapping (its config keeps the field; published Gemma 3
configs set it null); tidal applies it, so the Gemma 3 reference is transformers' eager
attention given the cap, as its Gemma 2 passes it (see hf_softcap_patch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TIDAL_TRITON_TESTS_INTERPRET") != "1"
if not ON_GPU:  # before triton decorates the kernels (tests/test_triton_attention.py does the same)
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from tidal.protocol.config import read_model_limits  # noqa: E402
from tidal.protocol.sliding_window import (  # noqa: E402
    kv_sliding_window,
    layer_sliding_windows,
    model_kv_sliding_window,
)
from tidal.worker.attention import Attention  # noqa: E402
from tidal.worker.attention_cpu import CpuAttentionBackend  # noqa: E402
from tidal.worker.attention_metadata import AttentionMetadata  # noqa: E402
from tidal.worker.attention_torch import TorchAttentionBackend, causal_attention  # noqa: E402
from tidal.worker.cpu_kernels import cpu_kernels  # noqa: E402
from tidal.worker.hf_config import load_hf_config  # noqa: E402
from tidal.worker.layers.layernorm import GemmaRMSNorm  # noqa: E402
from tidal.worker.loader import load_model  # noqa: E402

try:
    import test_models as tm
except ImportError:  # tests/ made a package
    import tests.test_models as tm  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATOL = tm.ATOL
WINDOW = 8
VOCAB = 512
# The small shape both models share: GQA 4/2, head_dim 16 (heads x head_dim != hidden), a
# query_pre_attn_scalar that is not head_dim (so the scale is its own), both soft-caps small
# enough to bend the scores and logits these weights give.
COMMON: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=48, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=256, sliding_window=WINDOW,
    query_pre_attn_scalar=24, initializer_range=0.1, rms_norm_eps=1e-6, attn_logit_softcapping=2.0,
    final_logit_softcapping=4.0, bos_token_id=0, eos_token_id=2, pad_token_id=0)
GEMMA3_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
               "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}}
GEMMA3_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@contextlib.contextmanager
def hf_softcap_patch() -> Iterator[None]:
    """transformers' Gemma 3 eager attention handed the layer's attn_logit_softcapping (its
    Gemma3Attention omits it; Gemma2Attention passes it to the same function)."""
    from transformers.models.gemma3 import modeling_gemma3 as mg

    eager = mg.eager_attention_forward

    def with_cap(module: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("softcap", module.attn_logit_softcapping)
        return eager(module, *args, **kwargs)

    mg.eager_attention_forward = with_cap
    try:
        yield
    finally:
        mg.eager_attention_forward = eager


def make_gemma(out_dir: str, arch: str, seed: int, **overrides: Any) -> str:
    """A Gemma checkpoint (config, safetensors, the byte-level tokenizer make_model writes)."""
    import transformers

    from tidal.frontend.entrypoints.make_model import write_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    write_tokenizer(out_dir, VOCAB)
    kwargs = {**COMMON, **overrides}
    if arch == "gemma2":
        config, model_cls = transformers.Gemma2Config(**kwargs), transformers.Gemma2ForCausalLM
    else:
        kwargs.setdefault("rope_parameters", json.loads(json.dumps(GEMMA3_ROPE)))
        kwargs.setdefault("layer_types", list(GEMMA3_LAYERS))
        config, model_cls = transformers.Gemma3TextConfig(**kwargs), transformers.Gemma3ForCausalLM
    config.architectures = [model_cls.__name__]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):  # HF inits them to 0 (a scale of 1): make 1 + w matter
                    param.normal_(0.0, 0.3)
    model.config.dtype = torch.float32
    model.eval().save_pretrained(out_dir)
    return out_dir


def load_hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> dict[str, tm.Loaded]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    out: dict[str, tm.Loaded] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        for seed, arch in enumerate(("gemma2", "gemma3")):
            path = make_gemma(str(tmp_path_factory.mktemp(arch)), arch, seed)
            ours = load_model(path, load_hf_config(path), torch.float32)
            out[arch] = tm.Loaded(path, ours, load_hf(path), 4, VOCAB)
            _LOADED.append(ours)
    return out


@contextlib.contextmanager
def reference(arch: str) -> Iterator[None]:
    with hf_softcap_patch() if arch == "gemma3" else contextlib.nullcontext():
        yield


def hf_logits(m: tm.Loaded, arch: str, tokens: list[int]) -> torch.Tensor:
    with reference(arch):
        return tm.hf_logits(m.hf, tokens)


def use_backend(model: torch.nn.Module, monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    """TIDAL_ATTENTION_BACKEND=backend for `model`'s layers (each picks its backend once)."""
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", backend)
    for layer in model.modules():
        if isinstance(layer, Attention):
            layer.backend = None


_LOADED: list[torch.nn.Module] = []  # the module's shared models, for _fresh_backends


@pytest.fixture(autouse=True)
def _fresh_backends() -> Iterator[None]:
    """After each test, every shared model's layers pick their backend again."""
    yield
    for model in _LOADED:
        for layer in model.modules():
            if isinstance(layer, Attention):
                layer.backend = None


# ----------------------------------------------------------------------------- the models
def test_models_are_what_the_configs_say(models: dict[str, tm.Loaded]) -> None:
    """Per-layer windows from layer_types (Gemma 2: alternating from a local layer 0), the
    soft cap and query_pre_attn_scalar scale on every layer, Gemma 3's two RoPE tables; the
    KV cache may free nothing (global layers read every position)."""
    g2, g3 = models["gemma2"].model, models["gemma3"].model
    assert [layer.self_attn.attn.sliding_window for layer in g2.model.layers] == [WINDOW, None, WINDOW, None]
    assert [layer.self_attn.attn.sliding_window for layer in g3.model.layers] == [WINDOW, WINDOW, None, WINDOW]
    for model in (g2, g3):
        attns = [layer.self_attn.attn for layer in model.model.layers]
        assert {(a.logits_soft_cap, a.scale) for a in attns} == {(2.0, 24**-0.5)}
        assert model.final_logit_softcapping == 4.0 and model.lm_head.tied
    ropes = {layer.self_attn.qk_norm_rope.rotary_emb for layer in g3.model.layers}
    assert sorted((r.base, r.rope_type) for r in ropes) == [(100.0, "default"), (5000.0, "linear")]
    assert g3.model.layers[0].self_attn.qk_norm_rope.q_norm is not None
    assert g2.model.layers[0].self_attn.qk_norm_rope.q_norm is None
    assert all(model_kv_sliding_window(m.path) is None for m in models.values())


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_prefill_logits_match(models: dict[str, tm.Loaded], arch: str) -> None:
    """Two prompts (23 and 9 tokens: longer and shorter than the window) in one paged batch,
    and the no-cache path, give transformers' logits."""
    m = models[arch]
    a, b = tm.rand_tokens(23, VOCAB, 1), tm.rand_tokens(9, VOCAB, 2)
    kv = tm.PagedKV(m.model, m.block_size)
    try:
        logits = kv.step([(0, a, 0), (1, b, 0)])
    finally:
        kv.release()
    torch.testing.assert_close(logits[:23], hf_logits(m, arch, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[23:], hf_logits(m, arch, b), atol=ATOL, rtol=0)
    with torch.no_grad():
        plain = m.model.compute_logits(m.model(torch.tensor(a), torch.arange(23)))
    torch.testing.assert_close(plain, hf_logits(m, arch, a), atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_soft_caps_and_window_change_the_logits(models: dict[str, tm.Loaded], arch: str) -> None:
    """The comparisons above would catch a dropped soft cap or window: each changes the logits
    of a 30-token prompt by far more than the tolerance."""
    m = models[arch]
    tokens = tm.rand_tokens(30, VOCAB, 3)
    ids, pos = torch.tensor(tokens), torch.arange(30)
    attns = [mod for mod in m.model.modules() if isinstance(mod, Attention)]

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return m.model.compute_logits(m.model(ids, pos))

    base = logits()
    for attr, off in (("logits_soft_cap", None), ("sliding_window", None)):
        saved = [getattr(a, attr) for a in attns]
        for a in attns:
            setattr(a, attr, off)
        try:
            assert (logits() - base).abs().max() > 100 * ATOL, attr
        finally:
            for a, value in zip(attns, saved):
                setattr(a, attr, value)
    cap, m.model.final_logit_softcapping = m.model.final_logit_softcapping, None
    try:
        assert (logits() - base).abs().max() > 100 * ATOL
    finally:
        m.model.final_logit_softcapping = cap
    assert base.abs().max() < 4.0  # capped


@pytest.fixture
def no_cpu_kernels(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The torch twins of the CPU kernels (norms, q/k norm + RoPE): what a GPU runs."""
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
    cpu_kernels.cache_clear()
    yield
    cpu_kernels.cache_clear()


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
@pytest.mark.parametrize("backend", ["torch", "cpu", "torch-ops-only"])
def test_incremental_and_mixed_batch(models: dict[str, tm.Loaded], arch: str, backend: str,
                                     monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    """Prefills, chunks over cached context, decodes of sequences at different lengths (past
    the window) in mixed batches, on the torch backend and the C-kernel one (and the torch
    backend with no C kernels anywhere): every position's logits are transformers'."""
    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("no C compiler: kernels unavailable")
    if backend == "torch-ops-only":
        request.getfixturevalue("no_cpu_kernels")
        backend = "torch"
    m = models[arch]
    use_backend(m.model, monkeypatch, backend)
    seqs = {s: tm.rand_tokens(n, VOCAB, 10 + s) for s, n in ((0, 26), (1, 19), (2, 12))}
    ref = {s: hf_logits(m, arch, t) for s, t in seqs.items()}
    kv = tm.PagedKV(m.model, m.block_size, seed=3)
    got: dict[int, dict[int, torch.Tensor]] = {s: {} for s in seqs}

    def run(spans: list[tuple[int, int, int]]) -> None:  # (seq, start, end)
        kv.run_spans(seqs, spans, got)

    try:
        run([(1, 0, 11), (2, 0, 5)])
        run([(2, 5, 6), (0, 0, 9), (1, 11, 12)])
        run([(1, 12, 13), (0, 9, 20), (2, 6, 7)])  # a chunk over cached context longer than the window
        for step in range(5):
            run([(0, 20 + step, 21 + step), (2, 7 + step, 8 + step), (1, 13 + step, 14 + step)])
        run([(0, 25, 26), (1, 18, 19)])
    finally:
        kv.release()
    backends = {type(layer.backend).__name__ for layer in m.model.modules() if isinstance(layer, Attention)}
    assert backends == {"TorchAttentionBackend" if backend == "torch" else "CpuAttentionBackend"}
    for s, by_pos in got.items():
        assert len(by_pos) == len(seqs[s])
        for p, row in by_pos.items():
            torch.testing.assert_close(row, ref[s][p], atol=ATOL, rtol=0, msg=lambda msg: f"seq {s} pos {p}: {msg}")


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_llm_generate_greedy_matches_hf_with_prefix_caching(models: dict[str, tm.Loaded], tidal_cache_dir: str,
                                                            backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine (scheduler, prefix cache, model runner, sampler), greedy, 12 tokens
    after prompts of 9-21 (past the window): transformers' generate(). The second batch's first
    prompt shares 16 tokens with the first batch's, which come from the prefix cache."""
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("no C compiler: kernels unavailable")
    monkeypatch.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", backend)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    first = tm.rand_tokens(20, VOCAB, 40)
    batches = [[first], [first[:16] + tm.rand_tokens(5, VOCAB, 41), tm.rand_tokens(9, VOCAB, 42)]]
    for arch, m in models.items():
        with LLM(model=m.path, dtype="float32", device="cpu", multiprocessing=False, max_model_len=64,
                 num_kv_blocks=64, block_size=4, enable_prefix_caching=True) as llm:
            outs = [llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
                    for batch in batches]
        assert outs[1][0].num_cached_tokens == 16, arch
        for batch, batch_outs in zip(batches, outs):
            for prompt, out in zip(batch, batch_outs):
                with torch.no_grad(), reference(arch):
                    want = m.hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
                assert list(out.outputs[0].token_ids) == want, (arch, len(prompt))


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_bfloat16_as_close_to_float32_as_transformers_bfloat16(models: dict[str, tm.Loaded], arch: str) -> None:
    """The checkpoint in bf16: the embedding scale is sqrt(hidden_size) rounded to bf16 (as
    transformers rounds it), and the logits are within twice transformers' own bf16 distance
    of the float32 ones."""
    from transformers import AutoModelForCausalLM

    m = models[arch]
    ours = load_model(m.path, load_hf_config(m.path), torch.bfloat16)
    assert float(ours.model.normalizer) == float(torch.tensor(COMMON["hidden_size"] ** 0.5, dtype=torch.bfloat16))
    hf16 = AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    tokens = tm.rand_tokens(21, VOCAB, 9)
    ref = hf_logits(m, arch, tokens)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(tokens), torch.arange(len(tokens)))).float()
    hf_err = (hf_logits(tm.Loaded(m.path, ours, hf16, 4, VOCAB), arch, tokens).float() - ref).abs().max().item()
    our_err = (got - ref).abs().max().item()
    assert hf_err > 0 and our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)


def test_gemma3_reference_needs_the_patch(models: dict[str, tm.Loaded]) -> None:
    """transformers' own Gemma 3 ignores attn_logit_softcapping: without hf_softcap_patch its
    logits differ from tidal's (which applies it) -- the reason for the patch."""
    m = models["gemma3"]
    tokens = tm.rand_tokens(20, VOCAB, 5)
    assert (tm.hf_logits(m.hf, tokens) - hf_logits(m, "gemma3", tokens)).abs().max() > 100 * ATOL


def test_gemma3_without_attention_softcap_matches_plain_transformers(tmp_path: Any, tidal_cache_dir: str) -> None:
    """The published Gemma 3 configs' case (attn_logit_softcapping null, no final cap, the
    layer pattern from sliding_window_pattern): transformers' own model, unpatched, in its
    default attention."""
    from transformers import AutoModelForCausalLM

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        path = make_gemma(str(tmp_path / "g3"), "gemma3", 7, attn_logit_softcapping=None,
                          final_logit_softcapping=None, layer_types=None, sliding_window_pattern=3,
                          rope_parameters=None, rope_theta=20000.0, rope_local_base_freq=50.0)
    ours = load_model(path, load_hf_config(path), torch.float32)
    assert [layer.self_attn.attn.sliding_window for layer in ours.model.layers] == [WINDOW, WINDOW, None, WINDOW]
    assert {layer.self_attn.attn.logits_soft_cap for layer in ours.model.layers} == {None}
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = tm.rand_tokens(21, VOCAB, 6)
    kv = tm.PagedKV(ours, 4)
    try:
        logits = torch.cat([kv.step([(0, tokens[:13], 0)])] + [kv.step([(0, [tokens[p]], p)]) for p in range(13, 21)])
    finally:
        kv.release()
    torch.testing.assert_close(logits, tm.hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path: Any) -> None:
    """A Gemma3ForConditionalGeneration checkpoint: its text_config and language_model weights
    load (the vision tower's are skipped), and text-only logits are transformers' multimodal
    model's; the torch-free readers see the text config too. Both soft caps off, as in the
    published multimodal configs (transformers 5's Gemma3ForConditionalGeneration applies
    neither; tidal, as its text model, would)."""
    import transformers

    text = transformers.Gemma3TextConfig(**{**COMMON, "rope_parameters": json.loads(json.dumps(GEMMA3_ROPE)),
                                            "layer_types": list(GEMMA3_LAYERS), "attn_logit_softcapping": None,
                                            "final_logit_softcapping": None})
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=28, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    config.architectures = ["Gemma3ForConditionalGeneration"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        hf = transformers.Gemma3ForConditionalGeneration(config)
    hf.config.dtype = torch.float32
    path = str(tmp_path / "mm")
    hf.eval().save_pretrained(path)

    cfg = load_hf_config(path)
    assert cfg.model_type == "gemma3_text" and cfg.architectures == ["Gemma3ForConditionalGeneration"]
    ours = load_model(path, cfg, torch.float32)
    assert type(ours).__name__ == "Gemma3ForConditionalGeneration"
    assert not any("vision" in name for name, _ in ours.named_parameters())
    tokens = tm.rand_tokens(20, VOCAB, 8)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(tokens), torch.arange(20)))
        want = hf(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert read_model_limits(path) == (VOCAB, 256)
    assert model_kv_sliding_window(path) is None


# ------------------------------------------------------------------- config rules (torch-free)
def test_layer_windows_from_config_json_without_layer_types() -> None:
    """config.json as published (no layer_types): transformers' default patterns, by
    architecture or by model_type alone; every layer sliding is the only case where the KV
    cache may free blocks."""
    g2 = dict(architectures=["Gemma2ForCausalLM"], num_hidden_layers=4, sliding_window=4096)
    assert layer_sliding_windows(SimpleNamespace(**g2)) == [4096, None, 4096, None]
    assert kv_sliding_window(SimpleNamespace(**g2)) is None
    g3 = dict(model_type="gemma3_text", num_hidden_layers=13, sliding_window=512, sliding_window_pattern=6)
    want = [None if (i + 1) % 6 == 0 else 512 for i in range(13)]
    assert layer_sliding_windows(SimpleNamespace(**g3)) == want
    g3.pop("sliding_window_pattern")  # Gemma3TextConfig's default, 6
    assert layer_sliding_windows(SimpleNamespace(**g3)) == want
    every = dict(g3, layer_types=["sliding_attention"] * 13)
    assert kv_sliding_window(SimpleNamespace(**every)) == 512
    assert layer_sliding_windows(SimpleNamespace(**dict(g3, sliding_window=None))) == [None] * 13
    with pytest.raises(ValueError, match="chunked_attention"):
        layer_sliding_windows(SimpleNamespace(**dict(g3, layer_types=["chunked_attention"] * 13)))


def test_multimodal_config_json_reads_with_transformers_defaults(tmp_path: Any) -> None:
    """A Gemma 3 multimodal config.json states few text_config fields (google/gemma-3-4b-it:
    no vocab_size, no max_position_embeddings): the torch-free readers fill transformers'
    defaults, and do not stretch the 128K context by the linear RoPE factor (vLLM's rule:
    Gemma 3's max_position_embeddings is already the scaled length)."""
    cfg = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                           "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert read_model_limits(str(tmp_path)) == (262_208, 131_072)
    assert read_model_limits(str(tmp_path), disable_sliding_window=True) == (262_208, 1024)
    assert model_kv_sliding_window(str(tmp_path)) is None


@pytest.mark.parametrize("field,value,match", [
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "relu", "hidden_activation"),
])
def test_unsupported_config_fields_are_refused(models: dict[str, tm.Loaded], field: str, value: Any,
                                               match: str) -> None:
    from tidal.worker.models.registry import get_model_class

    for m in models.values():
        cfg = load_hf_config(m.path)
        setattr(cfg, field, value)
        with torch.device("meta"), pytest.raises(ValueError, match=match):
            get_model_class(cfg)(cfg)


# --------------------------------------------------------------------------- published configs
# name -> (parameters on the model card / transformers' count, layer windows of the first 6)
PUBLISHED = {"gemma-2-2b-it": (2_614_341_888, [4096, None] * 3),
             "gemma-3-1b-it": (999_885_952, [512] * 5 + [None])}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_builds_with_its_size(name: str) -> None:
    """scripts/configs/<name> builds on the meta device with the model's parameter count
    (transformers' count for the same config), its layers' windows and soft caps."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tidal.worker.models.registry import get_model_class

    path = os.path.join(ROOT, "scripts", "configs", name)
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg)
        hf = AutoModelForCausalLM.from_config(cfg)
    count, windows = PUBLISHED[name]
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in hf.parameters()) == count
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers][:6] == windows
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == [type(model).__name__]
    caps = {layer.self_attn.attn.logits_soft_cap for layer in model.model.layers}
    assert caps == {raw.get("attn_logit_softcapping")} and model.final_logit_softcapping == raw.get(
        "final_logit_softcapping")
    assert model_kv_sliding_window(path) is None
    assert read_model_limits(path)[1] == raw["max_position_embeddings"]


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_config_loads_dummy_weights(name: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """load_format="dummy" of the published shape (hidden size, heads, head_dim 256, soft caps),
    with two layers (one local, one global) and a small vocabulary to stay cheap, in bf16:
    finite logits through the paged cache and the C kernels' head_dim 256 path."""
    from transformers import AutoConfig

    path = tmp_path / name
    path.mkdir()
    with open(os.path.join(ROOT, "scripts", "configs", name, "config.json")) as f:
        raw = json.load(f)
    raw.update(num_hidden_layers=2, vocab_size=1024, layer_types=["sliding_attention", "full_attention"])
    (path / "config.json").write_text(json.dumps(raw))
    cfg = AutoConfig.from_pretrained(str(path))
    model = load_model(str(path), cfg, torch.bfloat16, load_format="dummy")
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [raw["sliding_window"], None]
    norms = [mod for mod in model.modules() if isinstance(mod, GemmaRMSNorm)]
    assert norms and all(bool((n.weight == 0).all()) and bool((n.kernel_weight == 1).all()) for n in norms)
    tokens = tm.rand_tokens(12, 1024, 1)
    kv = tm.PagedKV(model, 16, num_blocks=4, cache_dtype=torch.bfloat16)
    try:
        logits = torch.cat([kv.step([(0, tokens[:10], 0)]), kv.step([(0, tokens[10:11], 10)]),
                            kv.step([(0, tokens[11:], 11)])])
    finally:
        kv.release()
    assert logits.shape == (12, 1024) and torch.isfinite(logits.float()).all()


# --------------------------------------------------------------- soft-capping in every backend
def _batch(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, block_size: int,
           seed: int) -> dict[str, Any]:
    """(query_len, seq_len) per sequence: new q/k/v, shuffled cache blocks holding random
    earlier context, slots and tables (with a padding column)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // block_size) for _, n in seqs]
    num_blocks = sum(need) + 2
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(need) + 1, dtype=torch.long)
    qsl, slots = [0], []
    for i, ((q_len, n), b) in enumerate(zip(seqs, need)):
        tables[i, :b] = torch.tensor([pool.pop() for _ in range(b)])
        qsl.append(qsl[-1] + q_len)
        slots += [int(tables[i, p // block_size]) * block_size + p % block_size for p in range(n - q_len, n)]
    shape = (num_blocks, block_size, kv_heads, head_dim)
    t = qsl[-1]
    # Scores of a few units: a cap of 1.5 bends most of them.
    return dict(q=2 * torch.randn(t, heads, head_dim, generator=g), k=torch.randn(t, kv_heads, head_dim, generator=g),
                v=torch.randn(t, kv_heads, head_dim, generator=g), k_cache=torch.randn(shape, generator=g),
                v_cache=torch.randn(shape, generator=g), tables=tables, qsl=qsl, slots=torch.tensor(slots),
                lens=[n for _, n in seqs], block_size=block_size)


def _softcap_reference(b: dict[str, Any], scale: float, cap: float | None, window: int | None) -> torch.Tensor:
    """From the definition, in float64, one query row at a time: scores s = q.k * scale over the
    sequence's own positions (causal, the last `window`), s -> cap * tanh(s / cap), softmax, @ v."""
    q, k, v = b["q"].double(), b["k"].double(), b["v"].double()
    heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
    flat_k = b["k_cache"].double().clone().view(-1, kv_heads, d)
    flat_v = b["v_cache"].double().clone().view(-1, kv_heads, d)
    flat_k[b["slots"]], flat_v[b["slots"]] = k, v
    bs, out = b["block_size"], torch.empty_like(q)
    for i, n in enumerate(b["lens"]):
        start, end = b["qsl"][i], b["qsl"][i + 1]
        ctx = [int(b["tables"][i, p // bs]) * bs + p % bs for p in range(n)]
        for row in range(start, end):
            pos = n - (end - row)
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(heads):
                j = h // (heads // kv_heads)
                keys, values = flat_k[ctx[first:pos + 1], j], flat_v[ctx[first:pos + 1], j]
                s = keys @ q[row, h] * scale
                if cap is not None:
                    s = cap * torch.tanh(s / cap)
                out[row, h] = torch.softmax(s, 0) @ values
    return out


# decode | plain prefill longer than the window | chunk over cached context | long decode
SOFTCAP_SEQS = [(1, 9), (13, 13), (6, 30), (1, 45)]


def _run(backend: Any, b: dict[str, Any], scale: float, cap: float | None, window: int | None) -> torch.Tensor:
    meta = AttentionMetadata.build(b["slots"], b["qsl"], b["lens"], b["tables"], b["block_size"])
    return backend.forward(b["q"], b["k"], b["v"], b["k_cache"].clone(), b["v_cache"].clone(), meta, scale,
                           window, softcap=cap)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("head_dim,window", [(16, None), (64, 7), (256, 7)])
def test_softcap_in_torch_and_cpu_backends(backend: str, head_dim: int, window: int | None) -> None:
    """Prefill spans (torch path in both), the gathered decodes (torch) and the C decode kernel
    (cpu, its head_dim 64 / 256 copies and the generic one) soft-cap as the reference; the
    reference without the cap is far off, so the cap is applied, not ignored."""
    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("no C compiler: kernels unavailable")
    impl = TorchAttentionBackend() if backend == "torch" else CpuAttentionBackend()
    b = _batch(SOFTCAP_SEQS, heads=4, kv_heads=2, head_dim=head_dim, block_size=4, seed=head_dim)
    scale, cap = head_dim**-0.5, 1.5
    got = _run(impl, b, scale, cap, window).double()
    want = _softcap_reference(b, scale, cap, window)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    assert (got - _softcap_reference(b, scale, None, window)).abs().max() > 1e-2
    # without a cap the same backend is plain attention
    torch.testing.assert_close(_run(impl, b, scale, None, window).double(), _softcap_reference(b, scale, None, window),
                               atol=2e-5, rtol=0)


def test_softcap_in_the_c_kernel_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """The C decode kernel runs (not the torch fallback) for soft-capped decodes, on a half
    cache too; with the cap only in its arguments (the torch path made to fail)."""
    if cpu_kernels() is None:
        pytest.skip("no C compiler: kernels unavailable")

    def no_torch(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("torch decode path used")

    monkeypatch.setattr(TorchAttentionBackend, "_decode", no_torch)
    b = _batch([(1, 5), (1, 37), (1, 64)], heads=8, kv_heads=2, head_dim=128, block_size=16, seed=4)
    for cache_dtype in (torch.float32, torch.bfloat16):
        case = dict(b, k_cache=b["k_cache"].to(cache_dtype), v_cache=b["v_cache"].to(cache_dtype))
        # the reference attends the new K/V as the cache holds them (rounded on write)
        rounded = dict(case, k=b["k"].to(cache_dtype).float(), v=b["v"].to(cache_dtype).float())
        got = _run(CpuAttentionBackend(), case, 0.1, 3.0, None).double()
        torch.testing.assert_close(got, _softcap_reference(rounded, 0.1, 3.0, None), atol=2e-5, rtol=0)


def test_softcap_without_a_cache_and_in_long_prefills(monkeypatch: pytest.MonkeyPatch) -> None:
    """causal_attention (a run without KV cache) soft-caps too, and a prefill cut into query
    chunks (SOFTCAP_MAX_SCORES) equals it uncut."""
    from tidal.worker import attention_torch

    b = _batch([(20, 20)], heads=4, kv_heads=1, head_dim=32, block_size=32, seed=9)
    want = _softcap_reference(b, 0.2, 2.5, 6)
    got = causal_attention(b["q"], b["k"], b["v"], 0.2, 6, 2.5).double()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    monkeypatch.setattr(attention_torch, "SOFTCAP_MAX_SCORES", 4 * 20 * 3)  # 3 query rows per chunk
    torch.testing.assert_close(causal_attention(b["q"], b["k"], b["v"], 0.2, 6, 2.5).double(), want,
                               atol=2e-5, rtol=0)
    torch.testing.assert_close(_run(TorchAttentionBackend(), b, 0.2, 2.5, None).double(),
                               _softcap_reference(b, 0.2, 2.5, None), atol=2e-5, rtol=0)


@pytest.mark.parametrize("window,splits", [(None, None), (7, None), (None, 3)])
def test_softcap_in_the_triton_backend(window: int | None, splits: int | None) -> None:
    """The Triton kernel (interpreter on CPU, compiled on a GPU) soft-caps mixed batches as the
    reference, under a window and with split-KV partials; without the cap it is plain again."""
    pytest.importorskip("triton")
    from tidal.worker.attention_triton import TritonAttentionBackend

    dev = torch.device("cuda" if ON_GPU else "cpu")
    seqs = [(1, 40), (1, 9), (1, 70)] if splits else SOFTCAP_SEQS
    b = _batch(seqs, heads=4, kv_heads=2, head_dim=64, block_size=16, seed=11)
    scale, cap = 0.125, 1.5
    for c in (cap, None):
        meta = AttentionMetadata.build(b["slots"].to(dev), b["qsl"], b["lens"], b["tables"].to(dev), 16)
        out = TritonAttentionBackend(force_num_splits=splits).forward(
            b["q"].to(dev), b["k"].to(dev), b["v"].to(dev), b["k_cache"].to(dev), b["v_cache"].to(dev), meta,
            scale, window, softcap=c)
        want = _softcap_reference(b, scale, c, window)
        torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=0)
        if c is not None:
            assert (out.cpu().double() - _softcap_reference(b, scale, None, window)).abs().max() > 1e-2


def test_attention_layer_refuses_a_bad_cap_and_norm_offsets() -> None:
    with pytest.raises(ValueError, match="logits_soft_cap"):
        Attention(2, 16, 0.25, logits_soft_cap=0.0)
    norm = GemmaRMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(-0.5, 0.5, 8))
    norm.process_weights_after_loading()
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + torch.linspace(-0.5, 0.5, 8))
    torch.testing.assert_close(norm(x), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(norm._norm(x), want, atol=1e-6, rtol=0)  # the torch path as the kernel's
