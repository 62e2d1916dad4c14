"""gpt-oss (GptOssForCausalLM) against transformers in float32 (paged KV, every CPU attention
backend, the whole engine through LLM, tensor parallel), attention sinks in every backend (torch,
the C kernel's sink argument, Triton) against a float64 reference written from the definition,
the refusal of MXFP4 checkpoints, and the published gpt-oss-20b config.

The checkpoint is a small random one made here with transformers: 4 layers alternating sliding
(window 6, shorter than every prompt) and full attention, 4 experts top-2, YaRN RoPE, random
biases and sinks large enough to matter, and a SwiGLU limit (1.5) low enough that the clamps
bind; the tests check that dropping the sinks, the window or the clamp moves the logits by far
more than the tolerance, so the parity checks would catch each.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before attention_triton is imported (see test_triton_attention)
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

from tidal.protocol.sliding_window import (  # noqa: E402
    kv_sliding_window,
    layer_sliding_windows,
    model_kv_sliding_window,
)
from tidal.worker.attention import Attention  # noqa: E402
from tidal.worker.attention_backends import AttentionBackend  # noqa: E402
from tidal.worker.attention_cpu import CpuAttentionBackend  # noqa: E402
from tidal.worker.attention_torch import TorchAttentionBackend, causal_attention  # noqa: E402
from tidal.worker.cpu_kernels import cpu_kernels  # noqa: E402
from tidal.worker.hf_config import load_hf_config  # noqa: E402
from tidal.worker.loader import load_model  # noqa: E402
from tidal.worker.models.gpt_oss import GptOssExperts  # noqa: E402

try:
    import test_models as tm
except ImportError:  # tests/ made a package
    import tests.test_models as tm  # type: ignore[no-redef]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATOL = tm.ATOL
WINDOW, VOCAB, BS = 6, 512, 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
CONFIG: dict[str, Any] = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, sliding_window=WINDOW, layer_types=LAYER_TYPES,
    max_position_embeddings=256, num_local_experts=4, num_experts_per_tok=2, swiglu_limit=1.5,
    initializer_range=0.1, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=2, pad_token_id=0,
    rope_parameters=dict(rope_type="yarn", factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                         original_max_position_embeddings=64, rope_theta=10000.0))


def make_gpt_oss(out_dir: str, seed: int = 0) -> str:
    """A GptOss checkpoint (config, safetensors, make_model's byte-level tokenizer)."""
    import transformers

    from tidal.frontend.entrypoints.make_model import write_tokenizer

    os.makedirs(out_dir, exist_ok=True)
    write_tokenizer(out_dir, VOCAB)
    config = transformers.GptOssConfig(**json.loads(json.dumps(CONFIG)))
    config.architectures = ["GptOssForCausalLM"]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.GptOssForCausalLM(config)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("bias"):  # zeros in HF's init: random ones make loading testable
                    param.normal_(0.0, 0.1)
                elif name.endswith("sinks"):  # large enough to take a real share of each row
                    param.normal_(0.0, 1.5)
                elif name.endswith("norm.weight"):
                    param.normal_(1.0, 0.2)
    model.config.dtype = torch.float32
    model.eval().save_pretrained(out_dir)
    return out_dir


def load_hf(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    return hf


_LOADED: list[torch.nn.Module] = []


@pytest.fixture(scope="module")
def m(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> tm.Loaded:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        path = make_gpt_oss(str(tmp_path_factory.mktemp("gpt_oss")))
    ours = load_model(path, load_hf_config(path), torch.float32)
    _LOADED.append(ours)
    return tm.Loaded(path, ours, load_hf(path), BS, VOCAB)


@pytest.fixture(autouse=True)
def _fresh_backends() -> Iterator[None]:
    """After each test, the shared model's layers pick their attention backend again."""
    yield
    for model in _LOADED:
        for layer in model.modules():
            if isinstance(layer, Attention):
                layer.backend = None


def _attns(model: torch.nn.Module) -> list[Attention]:
    return [mod for mod in model.modules() if isinstance(mod, Attention)]


def _triton_backends() -> list[AttentionBackend]:
    """The Triton backend, whole and forced to split-KV, where it runs here (CUDA, or CPU
    under the interpreter); none when triton is missing or was imported without it."""
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from tidal.worker import attention_triton
    except ImportError:
        return []
    if not (isinstance(attention_triton._attention_kernel, InterpretedFunction) or torch.cuda.is_available()):
        return []
    return [attention_triton.TritonAttentionBackend(), attention_triton.TritonAttentionBackend(force_num_splits=3)]


# ----------------------------------------------------------------------------- the model


def test_model_is_what_the_config_says(m: tm.Loaded) -> None:
    """Windows on the sliding layers only (the KV cache may free nothing), a sink per head on
    every layer, YaRN RoPE, 4 experts top-2 with the config's SwiGLU constants."""
    layers = m.model.model.layers
    assert [layer.self_attn.attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW, None]
    assert layer_sliding_windows(m.hf.config) == [WINDOW, None, WINDOW, None]
    assert kv_sliding_window(m.hf.config) is None and model_kv_sliding_window(m.path) is None
    assert all(layer.self_attn.sinks.shape == (4,) for layer in layers)
    assert m.model.model.rotary_emb.rope_type == "yarn"
    experts = [mod for mod in m.model.modules() if isinstance(mod, GptOssExperts)]
    assert len(experts) == 4 and {(e.num_experts, e.top_k, e.alpha, e.limit) for e in experts} == {(4, 2, 1.702, 1.5)}


def test_prefill_logits_match(m: tm.Loaded) -> None:
    """Two prompts (23 and 9 tokens, both longer than the window) in one paged batch, and the
    no-cache path, give transformers' logits."""
    tm.assert_prefill_logits_match(m)


def test_sinks_window_and_clamp_change_the_logits(m: tm.Loaded) -> None:
    """Each feature the parity tests rely on moves the logits far beyond their tolerance:
    no window, sinks of -inf (no share: a plain softmax), no SwiGLU clamp."""
    ids, pos = torch.tensor(tm.rand_tokens(24, VOCAB, 3)), torch.arange(24)
    experts = [mod for mod in m.model.modules() if isinstance(mod, GptOssExperts)]
    sinks = [layer.self_attn.sinks for layer in m.model.model.layers]

    def logits() -> torch.Tensor:
        with torch.no_grad():
            return m.model.compute_logits(m.model(ids, pos))

    base = logits()
    for what, objs, attr, off in (("window", _attns(m.model), "sliding_window", None),
                                  ("swiglu clamp", experts, "limit", 1e9), ("sinks", sinks, "data", None)):
        saved = [getattr(o, attr) for o in objs]
        for o, value in zip(objs, saved):
            setattr(o, attr, torch.full_like(value, float("-inf")) if what == "sinks" else off)
        try:
            assert (logits() - base).abs().max() > 100 * ATOL, what
        finally:
            for o, value in zip(objs, saved):
                setattr(o, attr, value)
    torch.testing.assert_close(logits(), base, atol=0, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_incremental_and_mixed_batch(m: tm.Loaded, backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills, chunks over cached context longer than the window, decodes at different
    lengths in mixed batches (the C-kernel backend's decodes in its sink kernel; Triton
    interpreted on CPU): every position's logits are transformers'."""
    if backend == "cpu" and cpu_kernels() is None:
        pytest.skip("no C compiler: kernels unavailable")
    if backend == "triton" and (torch.cuda.is_available() or not _triton_backends()):
        pytest.skip("the triton interpreter is not in use (this test runs on CPU tensors)")
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", backend)
    seqs = {s: tm.rand_tokens(n, VOCAB, 10 + s) for s, n in ((0, 26), (1, 19), (2, 12))}
    ref = {s: tm.hf_logits(m.hf, t) for s, t in seqs.items()}
    kv = tm.PagedKV(m.model, m.block_size, seed=3)
    got: dict[int, dict[int, torch.Tensor]] = {s: {} for s in seqs}
    try:
        kv.run_spans(seqs, [(1, 0, 11), (2, 0, 5)], got)
        kv.run_spans(seqs, [(2, 5, 6), (0, 0, 9), (1, 11, 12)], got)
        kv.run_spans(seqs, [(1, 12, 13), (0, 9, 20), (2, 6, 7)], got)
        for step in range(5):
            kv.run_spans(seqs, [(0, 20 + step, 21 + step), (2, 7 + step, 8 + step), (1, 13 + step, 14 + step)], got)
        kv.run_spans(seqs, [(0, 25, 26), (1, 18, 19)], got)
    finally:
        kv.release()
    want = {"torch": "TorchAttentionBackend", "cpu": "CpuAttentionBackend", "triton": "TritonAttentionBackend"}[backend]
    assert {type(a.backend).__name__ for a in _attns(m.model)} == {want}
    for s, by_pos in got.items():
        assert len(by_pos) == len(seqs[s])
        for p, row in by_pos.items():
            torch.testing.assert_close(row, ref[s][p], atol=ATOL, rtol=0, msg=lambda msg: f"seq {s} pos {p}: {msg}")


def test_llm_greedy_tokens_and_logprobs_match_transformers(m: tm.Loaded, tidal_cache_dir: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole engine (scheduler, prefix cache, chunked prefill, sampler) through LLM: greedy
    tokens are transformers' generate(), and the sampled and prompt logprobs are transformers'
    log-softmax over prompt + output (teacher forced) within 1e-3."""
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    monkeypatch.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    first = tm.rand_tokens(20, VOCAB, 40)
    prompts = [first, first[:12] + tm.rand_tokens(7, VOCAB, 41), tm.rand_tokens(9, VOCAB, 42)]
    with LLM(model=m.path, dtype="float32", device="cpu", multiprocessing=False, max_model_len=64,
             num_kv_blocks=64, block_size=BS, max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            want = m.hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)[0, len(prompt):]
        assert tokens == want.tolist(), len(prompt)
        ref = torch.log_softmax(tm.hf_logits(m.hf, prompt + tokens).float(), -1)  # row p predicts p + 1
        sampled = out.outputs[0].logprobs
        assert sampled is not None and len(sampled) == len(tokens)
        for i, (tok, pos) in enumerate(zip(tokens, sampled)):
            row = ref[len(prompt) - 1 + i]
            assert abs(pos[tok].logprob - float(row[tok])) < 1e-3, (len(prompt), i)
            top = row.topk(2)  # greedy: the chosen token is the first of them
            assert all(abs(pos[t].logprob - lp) < 1e-3 for t, lp in zip(top.indices.tolist(), top.values.tolist()))
        assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
        for p in range(1, len(prompt)):
            entry = out.prompt_logprobs[p]
            assert entry is not None and abs(entry[prompt[p]].logprob - float(ref[p - 1, prompt[p]])) < 1e-3, p
            top = ref[p - 1].topk(2)
            for tok, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert tok in entry and abs(entry[tok].logprob - lp) < 1e-3, (p, tok)


def test_bfloat16_checkpoint_loads_close_to_float32(m: tm.Loaded, tmp_path: Any) -> None:
    """A bf16 checkpoint (what gpt-oss models are served from once their MXFP4 experts are
    dequantized) loads, and its logits are within twice transformers' own bf16 distance."""
    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.bfloat16, attn_implementation="eager").eval()
    path = str(tmp_path / "bf16")
    hf16.save_pretrained(path)
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    ours = load_model(path, load_hf_config(path), torch.bfloat16)
    tokens = tm.rand_tokens(21, VOCAB, 9)
    ref = tm.hf_logits(m.hf, tokens)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(tokens), torch.arange(len(tokens)))).float()
    hf_err = (tm.hf_logits(hf16, tokens).float() - ref).abs().max().item()
    our_err = (got - ref).abs().max().item()
    assert hf_err > 0 and our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)


def test_mxfp4_checkpoint_is_refused_at_start_up(m: tm.Loaded, tmp_path: Any) -> None:
    """quantization_config.quant_method "mxfp4" (the published gpt-oss checkpoints): a
    ValueError naming MXFP4 and the bf16 alternative, from LLM before any process starts and
    from the worker's model class."""
    from tidal.frontend import LLM

    path = str(tmp_path / "mxfp4")
    shutil.copytree(m.path, path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match=r"(?i)mxfp4.*bf16"):
        LLM(model=path, dtype="float32", device="cpu", multiprocessing=False)
    hf_cfg = load_hf_config(m.path)
    hf_cfg.quantization_config = {"quant_method": "mxfp4"}
    with pytest.raises(ValueError, match=r"(?i)mxfp4.*bf16"):
        load_model(m.path, hf_cfg, torch.float32, load_format="dummy")


def test_tensor_parallel_2_matches_hf(m: tm.Loaded, tmp_path: Any) -> None:
    """TP=2 over gloo: each rank holds half the query heads (and their sinks), 1 of the 2 kv
    heads, half of every expert's intermediate columns (de-interleaved from the checkpoint);
    the down projection's bias is added once. Two prompts, then chunks on cached context."""
    import torch.multiprocessing as mp

    out_file = str(tmp_path / "out.pt")
    mp.start_processes(tm._tp_worker, args=(2, str(tmp_path / "init"), m.path, out_file), nprocs=2,
                       start_method="spawn")
    res = torch.load(out_file)
    ra, rb = tm.hf_logits(m.hf, res["a"]), tm.hf_logits(m.hf, res["b"])
    torch.testing.assert_close(res["first"], torch.cat([ra[:9], rb[:5]]), atol=ATOL, rtol=0)
    torch.testing.assert_close(res["second"], torch.cat([rb[5:], ra[9:]]), atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------- sinks


def reference_sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                             sinks: torch.Tensor, window: int | None, start: int = 0) -> torch.Tensor:
    """float64, one query row at a time: query i (position start + i) over keys j <= its
    position inside the window; weights exp(s_j) / (sum_j exp(s_j) + exp(sink_h))."""
    q, k, v, sinks = q.double(), k.double(), v.double(), sinks.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.zeros_like(q)
    for i in range(q.shape[0]):
        p = start + i
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(q.shape[1]):
            s = (k[lo : p + 1, h // groups] @ q[i, h]) * scale
            e = torch.exp(s - torch.maximum(s.max(), sinks[h]))
            denom = e.sum() + torch.exp(sinks[h] - torch.maximum(s.max(), sinks[h]))
            out[i, h] = (e[:, None] * v[lo : p + 1, h // groups]).sum(0) / denom
    return out


def _paged_sink_attention(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          sinks: torch.Tensor, window: int | None, cache_dtype: torch.dtype) -> torch.Tensor:
    """The 13 tokens through `backend` over a paged cache of non-contiguous blocks: a 7-token
    prefill, a 4-token chunk on cached context, two decodes."""
    from tidal.worker.attention_metadata import AttentionMetadata

    triton = type(backend).__name__ == "TritonAttentionBackend"
    dev = torch.device("cuda" if triton and torch.cuda.is_available() else "cpu")
    kc, vc = (torch.zeros(8, BS, k.shape[1], k.shape[2], dtype=cache_dtype, device=dev) for _ in range(2))
    table = torch.tensor([[5, 2, 7, 1]], device=dev)
    out = torch.empty_like(q)
    for s, e in ((0, 7), (7, 11), (11, 12), (12, 13)):
        slots = torch.tensor([int(table[0, p // BS]) * BS + p % BS for p in range(s, e)], device=dev)
        meta = AttentionMetadata.build(slots, [0, e - s], [e], table, BS)
        out[s:e] = backend.forward(q[s:e].to(dev), k[s:e].to(dev), v[s:e].to(dev), kc, vc, meta, 0.3, window,
                                   sinks=sinks.to(dev)).cpu()
    return out


@pytest.mark.parametrize("window", [None, 5])
def test_sink_attention_matches_reference(window: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """causal_attention (no cache) and every backend over a paged cache (the C kernel's sink
    argument, Triton whole and split) against the float64 reference; a sink of -inf is plain
    attention. Sinks above every score (6.0) and below (-1.0) take both of the kernels'
    rescaling branches. Over fp16 / bf16 caches the C kernel equals the torch path."""
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16
    q, k, v = (torch.randn(13, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    sinks = torch.tensor([2.0, -1.0, 0.5, 6.0])
    want = reference_sink_attention(q, k, v, 0.3, sinks, window)
    torch.testing.assert_close(causal_attention(q, k, v, 0.3, window, sinks=sinks).double(), want, atol=1e-5, rtol=0)
    no_sinks = torch.full((heads,), float("-inf"))
    torch.testing.assert_close(causal_attention(q, k, v, 0.3, window, sinks=no_sinks),
                               causal_attention(q, k, v, 0.3, window), atol=1e-6, rtol=0)
    for backend in (TorchAttentionBackend(), *_triton_backends()):
        torch.testing.assert_close(_paged_sink_attention(backend, q, k, v, sinks, window, torch.float32).double(),
                                   want, atol=1e-5, rtol=0, msg=lambda msg: f"{type(backend).__name__}: {msg}")
    half = {dt: _paged_sink_attention(TorchAttentionBackend(), q, k, v, sinks, window, dt)
            for dt in (torch.float16, torch.bfloat16)}
    if cpu_kernels() is None:
        pytest.skip("no C compiler: kernels unavailable")

    def no_torch_decode(*args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("a sink decode fell back to the torch path")

    monkeypatch.setattr(TorchAttentionBackend, "_decode", no_torch_decode)  # the C kernel decodes
    got = _paged_sink_attention(CpuAttentionBackend(), q, k, v, sinks, window, torch.float32)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=0)
    for dt, ref in half.items():
        got = _paged_sink_attention(CpuAttentionBackend(), q, k, v, sinks, window, dt)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=0, msg=lambda msg: f"{dt} cache: {msg}")


# ----------------------------------------------------------------------------- the real config


def test_real_config_builds_with_its_published_size() -> None:
    """scripts/configs/gpt-oss-20b builds on the meta device with transformers' parameter count
    for it, the model card's 21B (3.6B active per token: 4 of 32 experts, the input embedding
    not counted); its layers alternate sliding (128) and full attention from layer 0, and its
    YaRN extends 4096 positions to 131072."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tidal.protocol.config import read_model_limits
    from tidal.worker.models.registry import get_model_class

    path = os.path.join(ROOT, "scripts", "configs", "gpt-oss-20b")
    cfg = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = get_model_class(cfg)(cfg)
        hf = AutoModelForCausalLM.from_config(cfg)
    total = sum(p.numel() for p in model.parameters())
    assert total == sum(p.numel() for p in hf.parameters())
    experts = sum(p.numel() for mod in model.modules() if isinstance(mod, GptOssExperts) for p in mod.parameters())
    active = total - experts + experts * 4 // 32 - model.model.embed_tokens.weight.numel()
    assert abs(total - 20.9e9) < 0.02 * 20.9e9 and abs(active - 3.6e9) < 0.02 * 3.6e9, (total, active)
    assert layer_sliding_windows(cfg) == [128 if i % 2 == 0 else None for i in range(24)]
    assert read_model_limits(path) == (201088, 131072) and model_kv_sliding_window(path) is None
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["architectures"] == [type(model).__name__]


def test_real_config_loads_dummy_weights(tmp_path: Any) -> None:
    """load_format="dummy" of the published shape (hidden 2880, 64/8 heads of 64, biases,
    YaRN), cut to two layers (one sliding, one full), 4 experts and a small vocabulary to stay
    cheap, in bf16: finite logits through the paged cache, prefill then decodes."""
    from transformers import AutoConfig

    with open(os.path.join(ROOT, "scripts", "configs", "gpt-oss-20b", "config.json")) as f:
        raw = json.load(f)
    raw.update(num_hidden_layers=2, vocab_size=1024, num_local_experts=4, num_experts_per_tok=2,
               layer_types=["sliding_attention", "full_attention"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    model = load_model(str(tmp_path), AutoConfig.from_pretrained(str(tmp_path)), torch.bfloat16, load_format="dummy")
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [128, None]
    tokens = tm.rand_tokens(12, 1024, 1)
    kv = tm.PagedKV(model, 16, num_blocks=4, cache_dtype=torch.bfloat16)
    try:
        logits = torch.cat([kv.step([(0, tokens[:10], 0)]), kv.step([(0, tokens[10:11], 10)]),
                            kv.step([(0, tokens[11:], 11)])])
    finally:
        kv.release()
    assert logits.shape == (12, 1024) and torch.isfinite(logits.float()).all()
