"""Our Llama-family models against transformers in float32, through a paged KV cache."""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Iterator

import pytest
import torch

from tidal.frontend.entrypoints.make_model import make_model
from tidal.worker import attention_metadata
from tidal.worker.attention import Attention
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.cpu_kernels import cpu_kernels
from tidal.worker.forward_context import set_forward_context
from tidal.worker.layers.gemm import PanelWeight, half_storage_enabled
from tidal.worker.layers.linear import LinearBase
from tidal.worker.loader import load_model, resolve_dtype
from tidal.worker.models.registry import MODEL_REGISTRY, get_model_class

ATOL = 1e-4

# name -> (arch, make_model kwargs, block_size)
CONFIGS: dict[str, tuple[str, dict[str, Any], int]] = {
    # small qwen3, tied embeddings, GQA 4/2, sharded checkpoint
    "qwen3-tied": ("qwen3", dict(max_shard_size="60KB"), 4),
    # bigger qwen3, untied, head_dim * heads != hidden, GQA 8/2
    "qwen3-untied": (
        "qwen3",
        dict(vocab_size=600, hidden_size=96, num_layers=3, num_heads=8, num_kv_heads=2, head_dim=16, tie_word_embeddings=False),
        16,
    ),
    # llama with llama3 rope scaling, attention + mlp biases, untied, sharded
    "llama3-scaled": (
        "llama",
        dict(
            hidden_size=96,
            num_heads=6,
            num_kv_heads=2,
            rope_theta=50000.0,
            rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=256),
            max_shard_size="100KB",
            config_overrides=dict(attention_bias=True, mlp_bias=True),
        ),
        4,
    ),
    # qwen2 with qkv bias, multi-query (1 kv head), tied
    "qwen2-mqa": ("qwen2", dict(num_heads=4, num_kv_heads=1), 4),
    # mistral, no GQA, untied
    "mistral-mha": ("mistral", dict(num_heads=4, num_kv_heads=4, num_layers=3), 16),
}


@dataclass
class Loaded:
    path: str
    model: torch.nn.Module
    hf: Any
    block_size: int
    vocab_size: int


def load_configs(configs: dict[str, tuple[str, dict[str, Any], int]],
                 tmp_path_factory: pytest.TempPathFactory, cache_dir: str | None = None) -> dict[str, Loaded]:
    """Each config made with make_model (seeded by its index) and loaded by tidal and transformers;
    with `cache_dir`, the tokenizers are trained (or found) under it as TIDAL_CACHE_DIR."""
    if cache_dir is not None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TIDAL_CACHE_DIR", cache_dir)
            return load_configs(configs, tmp_path_factory)
    from transformers import AutoConfig, AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    out: dict[str, Loaded] = {}
    for i, (name, (arch, kwargs, block_size)) in enumerate(configs.items()):
        path = make_model(str(tmp_path_factory.mktemp(name)), arch, seed=i, **kwargs)
        cfg = AutoConfig.from_pretrained(path)
        model = load_model(path, cfg, torch.float32)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out[name] = Loaded(path, model, hf, block_size, cfg.vocab_size)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Loaded]:
    return load_configs(CONFIGS, tmp_path_factory)


@dataclass
class PagedKV:
    """Minimal stand-in for the model runner: caches bound to every Attention layer and a
    per-sequence block list drawn from a shuffled pool (non-contiguous block ids)."""

    model: torch.nn.Module
    block_size: int
    num_blocks: int = 96
    seed: int = 0
    cache_dtype: torch.dtype = torch.float32
    blocks: dict[int, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.free = list(range(1, self.num_blocks))  # block 0 unused: it is the table padding
        random.Random(self.seed).shuffle(self.free)
        for layer in self.model.modules():
            if isinstance(layer, Attention):
                shape = (self.num_blocks, self.block_size, layer.num_kv_heads, layer.head_dim)
                layer.k_cache = torch.zeros(shape, dtype=self.cache_dtype)
                layer.v_cache = torch.zeros(shape, dtype=self.cache_dtype)

    def slot(self, seq: int, pos: int) -> int:
        table = self.blocks.setdefault(seq, [])
        while len(table) <= pos // self.block_size:
            table.append(self.free.pop())
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def step(self, chunks: list[tuple[int, list[int], int]], pad: int = 0) -> torch.Tensor:
        """chunks: (seq id, new tokens, position of the first) -> logits [T, vocab].

        pad > 0 appends padding tokens outside every sequence with slot -1 (as a CUDA-graph
        runner pads), whose logits are dropped."""
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        for seq, toks, start in chunks:
            ids += toks
            positions += range(start, start + len(toks))
            slots += [self.slot(seq, p) for p in range(start, start + len(toks))]
            qsl.append(len(ids))
            seq_lens.append(start + len(toks))
        width = max(len(self.blocks[seq]) for seq, _, _ in chunks) + 1  # +1: padded columns too
        tables = torch.zeros(len(chunks), width, dtype=torch.long)
        for i, (seq, _, _) in enumerate(chunks):
            tables[i, : len(self.blocks[seq])] = torch.tensor(self.blocks[seq])
        ids, positions, slots = ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad
        meta = AttentionMetadata.build(torch.tensor(slots), qsl, seq_lens, tables, self.block_size)
        with torch.no_grad(), set_forward_context(meta):
            hidden = self.model(torch.tensor(ids), torch.tensor(positions))
            return self.model.compute_logits(hidden)[: qsl[-1]]

    def run_spans(self, seqs: dict[int, list[int]], spans: list[tuple[int, int, int]],
                  got: dict[int, dict[int, torch.Tensor]]) -> None:
        """One step over (seq, start, end) spans of `seqs`' tokens; each position's logits go
        to got[seq][position]."""
        logits = self.step([(s, seqs[s][a:e], a) for s, a, e in spans])
        row = 0
        for s, a, e in spans:
            for p in range(a, e):
                got[s][p] = logits[row]
                row += 1

    def release(self) -> None:
        for layer in self.model.modules():
            if isinstance(layer, Attention):
                layer.k_cache = layer.v_cache = torch.empty(0)


def hf_logits(hf: Any, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def rand_tokens(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match(models: dict[str, Loaded], name: str) -> None:
    assert_prefill_logits_match(models[name])


def assert_prefill_logits_match(m: Loaded) -> None:
    """Two prompts prefilled in one batch through the paged cache, and one without any
    attention metadata, give transformers' logits."""
    a, b = rand_tokens(23, m.vocab_size, 1), rand_tokens(9, m.vocab_size, 2)
    kv = PagedKV(m.model, m.block_size)
    try:
        logits = kv.step([(0, a, 0), (1, b, 0)])  # two prompts in one batch
    finally:
        kv.release()
    torch.testing.assert_close(logits[:23], hf_logits(m.hf, a), atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[23:], hf_logits(m.hf, b), atol=ATOL, rtol=0)
    # No metadata / no cache (profile run): plain causal attention over the whole input.
    with torch.no_grad():
        plain = m.model.compute_logits(m.model(torch.tensor(a), torch.arange(23)))
    torch.testing.assert_close(plain, hf_logits(m.hf, a), atol=ATOL, rtol=0)


@pytest.fixture
def torch_ops_only(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Run the torch twins of the CPU kernels (what GPUs and other dtypes run)."""
    monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
    cpu_kernels.cache_clear()
    yield
    cpu_kernels.cache_clear()


@pytest.mark.parametrize(
    "name,gather_limit,kernels",
    [(n, None, True) for n in CONFIGS]
    + [(n, None, False) for n in CONFIGS]
    + [("qwen3-untied", 40, False), ("llama3-scaled", 1, False)],
)
def test_incremental_and_mixed_batch(
    models: dict[str, Loaded], name: str, gather_limit: int | None, kernels: bool,
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest,
) -> None:
    if not kernels:
        request.getfixturevalue("torch_ops_only")
    if gather_limit is not None:  # force several decode groups per step (torch backend)
        monkeypatch.setattr(attention_metadata, "DECODE_GATHER_MAX_TOKENS", gather_limit)
    m = models[name]
    seqs = {s: rand_tokens(n, m.vocab_size, 10 + s) for s, n in ((0, 30), (1, 20), (2, 12))}
    ref = {s: hf_logits(m.hf, t) for s, t in seqs.items()}
    kv = PagedKV(m.model, m.block_size, seed=3)
    got: dict[int, dict[int, torch.Tensor]] = {s: {} for s in seqs}

    def run(spans: list[tuple[int, int, int]]) -> None:  # (seq, start, end)
        kv.run_spans(seqs, spans, got)

    try:
        run([(1, 0, 11), (2, 0, 5)])  # two prefills
        run([(2, 5, 6), (0, 0, 9), (1, 11, 12)])  # decode, fresh prefill, decode
        # mixed: decode, prefill chunk on top of cached context, decode
        run([(1, 12, 13), (0, 9, 21), (2, 6, 7)])
        for step in range(4):  # pure decode batches, sequences at different lengths
            run([(0, 21 + step, 22 + step), (2, 7 + step, 8 + step), (1, 13 + step, 14 + step)])
        logits = kv.step([(1, seqs[1][17:18], 17), (2, seqs[2][11:12], 11)], pad=3)  # padded batch
        got[1][17], got[2][11] = logits[0], logits[1]
        run([(0, 25, 30), (1, 18, 19)])  # last chunk of seq 0 with a decode after it
    finally:
        kv.release()
    for s, by_pos in got.items():
        for p, row in by_pos.items():
            torch.testing.assert_close(row, ref[s][p], atol=ATOL, rtol=0, msg=lambda msg: f"seq {s} pos {p}: {msg}")


def assert_greedy_matches_hf_generate(m: Loaded, new_tokens: int) -> None:
    """Greedy decoding one token per step through the paged cache == transformers' generate."""
    prompt = rand_tokens(7, m.vocab_size, 5)
    kv = PagedKV(m.model, m.block_size)
    tokens = list(prompt)
    try:
        logits = kv.step([(0, prompt, 0)])
        for _ in range(new_tokens):
            tokens.append(int(logits[-1].argmax()))
            logits = kv.step([(0, tokens[-1:], len(tokens) - 1)])
    finally:
        kv.release()
    with torch.no_grad():
        out = m.hf.generate(
            torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    assert tokens == out[0].tolist()


@pytest.mark.parametrize("name", ["qwen3-tied", "llama3-scaled"])
def test_greedy_matches_hf_generate(models: dict[str, Loaded], name: str) -> None:
    assert_greedy_matches_hf_generate(models[name], 24)


def test_fused_checkpoint_tensors_load_like_split_ones() -> None:
    """A checkpoint storing qkv_proj / gate_up_proj fused (shard_id None) loads the same."""
    from tidal.worker.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    qkv = QKVParallelLinear(16, 4, total_num_heads=4, total_num_kv_heads=2, bias=True)
    w, b = torch.randn(32, 16), torch.randn(32)
    qkv.weight.weight_loader(qkv.weight, w)
    qkv.bias.weight_loader(qkv.bias, b)
    assert torch.equal(qkv.weight, w) and torch.equal(qkv.bias, b)
    split = QKVParallelLinear(16, 4, total_num_heads=4, total_num_kv_heads=2, bias=True)
    for sid, (lo, hi) in zip("qkv", ((0, 16), (16, 24), (24, 32))):
        split.weight.weight_loader(split.weight, w[lo:hi], sid)
    assert torch.equal(split.weight, w)
    gate_up = MergedColumnParallelLinear(16, [8, 8])
    gate_up.weight.weight_loader(gate_up.weight, w[:16])
    assert torch.equal(gate_up.weight, w[:16])
    with pytest.raises(ValueError, match="size"):
        gate_up.weight.weight_loader(gate_up.weight, w[:10], 0)
    with pytest.raises(ValueError, match="size"):
        qkv.weight.weight_loader(qkv.weight, w[:30])


def test_dummy_weights_and_dtypes(models: dict[str, Loaded]) -> None:
    from transformers import AutoConfig

    path = models["qwen3-untied"].path
    cfg = AutoConfig.from_pretrained(path)
    ids, pos = torch.tensor(rand_tokens(10, cfg.vocab_size, 0)), torch.arange(10)
    outs = []
    for seed in (0, 0, 1):
        model = load_model(path, cfg, torch.bfloat16, load_format="dummy", seed=seed)
        with torch.no_grad():
            outs.append(model.compute_logits(model(ids, pos)))
    # bf16 on CPU keeps bf16 weights but computes in float32 when the half GEMM is built
    compute = torch.float32 if half_storage_enabled(torch.bfloat16, "cpu") else torch.bfloat16
    assert outs[0].dtype == compute and outs[0].shape == (10, cfg.vocab_size)
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], outs[2])

    assert resolve_dtype("auto", cfg) == torch.float32
    assert resolve_dtype("half", cfg) == torch.float16
    assert resolve_dtype("bfloat16", cfg) == torch.bfloat16
    cfg.dtype = "bfloat16"
    assert resolve_dtype("auto", cfg) == torch.bfloat16
    with pytest.raises(ValueError):
        resolve_dtype("int3", cfg)


def _paged_logits(model: torch.nn.Module, tokens: list[int], block_size: int, cache_dtype: torch.dtype) -> torch.Tensor:
    """Logits of every position: an 8-token prefill, a 2-token chunk over the cached context,
    then single-token decodes (the half-cache decode kernel on CPU)."""
    kv = PagedKV(model, block_size, cache_dtype=cache_dtype)
    try:
        parts = [kv.step([(0, tokens[:8], 0)]), kv.step([(0, tokens[8:10], 8)])]
        parts += [kv.step([(0, [tokens[p]], p)]) for p in range(10, len(tokens))]
    finally:
        kv.release()
    return torch.cat(parts)


@pytest.mark.parametrize("name", ["qwen3-tied", "llama3-scaled"])
@pytest.mark.parametrize("weights,dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                           (torch.float32, torch.bfloat16)])
def test_half_precision_close_to_fp32(models: dict[str, Loaded], name: str, weights: torch.dtype,
                                      dtype: torch.dtype) -> None:
    """fp16/bf16 weights and KV cache (or float32 weights over a half cache: kv_cache_dtype):
    as close to the float32 logits as transformers running the same checkpoint in the half
    dtype is (tidal keeps float32 activations on CPU, so it is usually closer)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    m = models[name]
    model = m.model if weights == torch.float32 else load_model(m.path, AutoConfig.from_pretrained(m.path), weights)
    if weights != torch.float32 and half_storage_enabled(dtype, "cpu"):
        linears = [mod for mod in model.modules() if isinstance(mod, LinearBase)]
        assert linears and all(isinstance(mod.packed_weight, PanelWeight) and mod.weight is None
                               and mod.packed_weight.dtype == dtype for mod in linears)
    tokens = rand_tokens(14, m.vocab_size, 4)
    logits = _paged_logits(model, tokens, m.block_size, dtype).float()
    ref = hf_logits(m.hf, tokens)
    hf_half = AutoModelForCausalLM.from_pretrained(m.path, dtype=dtype).eval()
    hf_distance = (hf_logits(hf_half, tokens).float() - ref).abs().max()
    distance = (logits - ref).abs().max()
    assert 0 < distance <= hf_distance, (float(distance), float(hf_distance))


def test_half_precision_in_torch_ops(models: dict[str, Loaded], monkeypatch: pytest.MonkeyPatch) -> None:
    """TIDAL_CPU_HALF_WEIGHTS=0 (and what runs where the half GEMM is not built): the model
    computes in bf16 through torch's own ops, within 15% of the logits' scale of float32."""
    from transformers import AutoConfig

    monkeypatch.setenv("TIDAL_CPU_HALF_WEIGHTS", "0")
    m = models["qwen3-tied"]
    model = load_model(m.path, AutoConfig.from_pretrained(m.path), torch.bfloat16)
    assert not half_storage_enabled(torch.bfloat16, "cpu")
    tokens = rand_tokens(12, m.vocab_size, 4)
    logits = _paged_logits(model, tokens, m.block_size, torch.bfloat16)
    ref = hf_logits(m.hf, tokens)
    assert logits.dtype == torch.bfloat16
    assert (logits.float() - ref).abs().max() < 0.15 * ref.abs().max()


def test_registry_and_loader_errors(tmp_path: Any, models: dict[str, Loaded]) -> None:
    from transformers import AutoConfig

    assert set(MODEL_REGISTRY) == {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                                   "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM", "Gemma2ForCausalLM",
                                   "Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "GptOssForCausalLM"}
    cfg = AutoConfig.from_pretrained(models["qwen3-tied"].path)
    cfg.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(ValueError, match="Qwen3ForCausalLM"):
        get_model_class(cfg)
    cfg.architectures = ["Qwen3ForCausalLM"]
    with pytest.raises(FileNotFoundError):
        load_model(str(tmp_path / "nope"), cfg, torch.float32)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(str(tmp_path), cfg, torch.float32)
    with pytest.raises(ValueError):
        load_model(str(tmp_path), cfg, torch.float32, load_format="pt")


def _tp_worker(rank: int, world: int, init_file: str, path: str, out_file: str) -> None:
    from transformers import AutoConfig

    from tidal.worker.parallel_state import all_reduce_min, destroy_distributed, get_tp_rank, init_distributed

    torch.set_num_threads(1)
    init_distributed(rank, world, f"file://{init_file}", "gloo", timeout_s=60)
    try:
        assert get_tp_rank() == rank and all_reduce_min(10 - rank) == 9
        cfg = AutoConfig.from_pretrained(path)
        model = load_model(path, cfg, torch.float32)
        a, b = rand_tokens(13, cfg.vocab_size, 1), rand_tokens(6, cfg.vocab_size, 2)
        kv = PagedKV(model, 4)
        first = kv.step([(0, a[:9], 0), (1, b[:5], 0)])
        second = kv.step([(1, b[5:], 5), (0, a[9:], 9)])
        if rank == 0:
            torch.save({"first": first, "second": second, "a": a, "b": b}, out_file)
        # Neither rank tears gloo down while the other may still use it: a rank that did so
        # early once aborted its peer ("terminate called without an active exception").
        torch.distributed.barrier()
    finally:
        destroy_distributed()
    # Skip interpreter finalization, where gloo's C++ threads can still abort the process; the
    # engine's worker processes end the same way (os._exit).
    os._exit(0)


def test_tensor_parallel_2_matches_hf(tmp_path: Any) -> None:
    """TP=2 over gloo: vocab not divisible by 2 (padded LM head), 1 kv head replicated on both
    ranks, qkv bias, row-parallel bias (llama attention_bias), sharded checkpoint."""
    import torch.multiprocessing as mp
    from transformers import AutoModelForCausalLM

    for arch, kwargs in (
        ("qwen2", dict(vocab_size=515, num_kv_heads=1, max_shard_size="50KB")),
        ("llama", dict(vocab_size=517, config_overrides=dict(attention_bias=True, mlp_bias=True))),
    ):
        path = make_model(str(tmp_path / arch), arch, **kwargs)
        out_file = str(tmp_path / f"{arch}.pt")
        mp.start_processes(
            _tp_worker, args=(2, str(tmp_path / f"{arch}.init"), path, out_file), nprocs=2, start_method="spawn"
        )
        res = torch.load(out_file)
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ra, rb = hf_logits(hf, res["a"]), hf_logits(hf, res["b"])
        assert res["first"].shape[-1] == hf.config.vocab_size
        torch.testing.assert_close(res["first"], torch.cat([ra[:9], rb[:5]]), atol=ATOL, rtol=0)
        torch.testing.assert_close(res["second"], torch.cat([rb[5:], ra[9:]]), atol=ATOL, rtol=0)


@pytest.fixture(autouse=True, scope="module")
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory) -> Any:
    # Tokenizers are cached under TIDAL_CACHE_DIR; keep test runs out of the user's cache.
    old = os.environ.get("TIDAL_CACHE_DIR")
    os.environ["TIDAL_CACHE_DIR"] = str(tmp_path_factory.mktemp("tidal-cache"))
    yield
    if old is None:
        os.environ.pop("TIDAL_CACHE_DIR", None)
    else:
        os.environ["TIDAL_CACHE_DIR"] = old


@pytest.mark.parametrize("name", ["qwen3-untied", "llama3-scaled"])
def test_bfloat16_as_close_to_float32_as_transformers_bfloat16(models: dict[str, Loaded], name: str) -> None:
    """bf16 runs the packed oneDNN GEMM and the torch ops (the C kernels are float32 only): its
    distance to the float32 reference must be of the order of transformers' own bf16 error."""
    from transformers import AutoConfig

    m = models[name]
    assert_bfloat16_as_close_as_transformers(m, load_model(m.path, AutoConfig.from_pretrained(m.path), torch.bfloat16))


def assert_bfloat16_as_close_as_transformers(m: Loaded, ours: torch.nn.Module) -> None:
    """`ours` (m's checkpoint loaded in bf16) is within twice transformers' bf16 distance of
    the float32 logits."""
    from transformers import AutoModelForCausalLM

    hf16 = AutoModelForCausalLM.from_pretrained(m.path, dtype=torch.bfloat16).eval()
    tokens = rand_tokens(21, m.vocab_size, 9)
    ref = hf_logits(m.hf, tokens)
    with torch.no_grad():
        got = ours.compute_logits(ours(torch.tensor(tokens), torch.arange(len(tokens)))).float()
    hf_err = (hf_logits(hf16, tokens).float() - ref).abs().max().item()
    our_err = (got - ref).abs().max().item()
    assert got.dtype == torch.float32 and hf_err > 0
    assert our_err <= 2 * hf_err + 1e-3, (our_err, hf_err)
