"""Sliding-window attention (Mistral, Qwen2) against transformers, and the KV blocks it frees.

Issue 34: attention limited to the window in every backend (C kernels, torch ops, Triton under
the interpreter), prompts and outputs several windows long with prefix caching, chunked prefill
and preemption on, and a sequence at 4x the window holding window-sized KV memory.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():  # before attention_triton is imported (see test_triton_attention)
    os.environ["TRITON_INTERPRET"] = "1"

import json  # noqa: E402
import math  # noqa: E402
import random  # noqa: E402
from types import SimpleNamespace  # noqa: E402
from typing import Any, Iterator  # noqa: E402

import pytest  # noqa: E402

from engine_utils import (  # noqa: E402
    assert_all_blocks_free, assert_greedy_equal, check_logprobs, greedy, hf_generate, hf_log_softmax, make_core,
    random_prompt, req, run_to_completion)
from tidal.frontend.entrypoints.make_model import make_model  # noqa: E402
from tidal.protocol.sliding_window import kv_sliding_window, layer_sliding_windows  # noqa: E402
from tidal.worker.attention_metadata import AttentionMetadata  # noqa: E402
from tidal.worker.attention_torch import TorchAttentionBackend  # noqa: E402
from tidal.worker.cpu_kernels import cpu_kernels  # noqa: E402

WINDOW, BS = 16, 4  # window a multiple of the block size, and one that is not (Qwen2 below)
MODEL_KW: dict[str, Any] = dict(vocab_size=512, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                max_position_embeddings=256)


# ----------------------------------------------------------------------------- which layers slide


def test_layer_windows_follow_transformers_configs() -> None:
    from transformers import MistralConfig, Qwen2Config

    qwen = Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=1)
    assert layer_sliding_windows(qwen) == [8 if t == "sliding_attention" else None for t in qwen.layer_types]
    assert layer_sliding_windows(qwen) == [None, 8, 8, 8] and kv_sliding_window(qwen) is None
    # The same from a raw config.json of an older checkpoint (no layer_types, no normalization).
    raw = dict(architectures=["Qwen2ForCausalLM"], num_hidden_layers=4, use_sliding_window=True,
               sliding_window=8, max_window_layers=1)
    assert layer_sliding_windows(SimpleNamespace(**raw)) == [None, 8, 8, 8]
    assert layer_sliding_windows(SimpleNamespace(**{**raw, "max_window_layers": 0})) == [8] * 4
    assert layer_sliding_windows(SimpleNamespace(**{**raw, "use_sliding_window": False})) == [None] * 4
    off = Qwen2Config(num_hidden_layers=2, sliding_window=8)  # use_sliding_window defaults to False
    assert layer_sliding_windows(off) == [None, None]
    mistral = MistralConfig(num_hidden_layers=3, sliding_window=8)
    mistral.architectures = ["MistralForCausalLM"]
    assert layer_sliding_windows(mistral) == [8] * 3 and kv_sliding_window(mistral) == 8


# ----------------------------------------------------------------------------- every backend


def _backends() -> list[Any]:
    from tidal.worker.attention_cpu import CpuAttentionBackend

    out: list[Any] = [pytest.param(TorchAttentionBackend(), id="torch"), pytest.param(CpuAttentionBackend(), id="cpu")]
    try:
        from triton.runtime.interpreter import InterpretedFunction

        from tidal.worker import attention_triton
    except ImportError:
        return out
    if isinstance(attention_triton._attention_kernel, InterpretedFunction) or torch.cuda.is_available():
        out += [pytest.param(attention_triton.TritonAttentionBackend(), id="triton"),
                pytest.param(attention_triton.TritonAttentionBackend(force_num_splits=3), id="triton-split")]
    return out


@pytest.mark.parametrize("backend", _backends())
@pytest.mark.parametrize("window", [7, 16])
def test_backend_attends_only_inside_the_window(backend: Any, window: int) -> None:
    """A mixed batch (decodes far past the window, a chunk on cached context, a fresh prompt
    longer than the window, short sequences) against a float64 reference; every block wholly
    before a sequence's window is NaN and its table entry points at a NaN block, as after the
    core freed it: one read of it would show."""
    if type(backend).__name__ == "CpuAttentionBackend" and cpu_kernels() is None:
        pytest.skip("no C compiler: the C-kernel backend is the torch one")
    dev = torch.device("cuda" if torch.cuda.is_available() and "Triton" in type(backend).__name__ else "cpu")
    gen = torch.Generator().manual_seed(window)
    heads, kv_heads, dim = 4, 2, 16
    seqs = [(1, 45), (6, 30), (1, 9), (20, 20), (1, 3), (3, 17)]  # (query_len, seq_len)
    num_blocks = sum(-(-n // BS) for _, n in seqs) + 1
    k_cache = torch.randn(num_blocks, BS, kv_heads, dim, generator=gen)
    v_cache = torch.randn(num_blocks, BS, kv_heads, dim, generator=gen)
    k_cache[0] = v_cache[0] = math.nan  # the freed-block stand-in
    ids = iter(torch.randperm(num_blocks - 1, generator=gen).add(1).tolist())
    tables = torch.zeros(len(seqs), 13, dtype=torch.long)
    qsl, slots = [0], []
    for i, (q_len, seq_len) in enumerate(seqs):
        for b in range(-(-seq_len // BS)):
            tables[i, b] = next(ids)
        qsl.append(qsl[-1] + q_len)
        slots += [int(tables[i, p // BS]) * BS + p % BS for p in range(seq_len - q_len, seq_len)]
    n = qsl[-1]
    q, k, v = (torch.randn(n, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    want = _reference(q, k, v, k_cache, v_cache, seqs, qsl, slots, tables, window)
    for i, (q_len, seq_len) in enumerate(seqs):  # free what lies wholly before the window
        for b in range(max(0, seq_len - q_len - window + 1) // BS):
            k_cache[tables[i, b]] = v_cache[tables[i, b]] = math.nan
            tables[i, b] = 0
    meta = AttentionMetadata.build(torch.tensor(slots, device=dev), qsl, [s for _, s in seqs], tables.to(dev), BS)
    out = backend.forward(q.to(dev), k.to(dev), v.to(dev), k_cache.to(dev), v_cache.to(dev), meta, dim**-0.5,
                          window)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=0)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               seqs: list[tuple[int, int]], qsl: list[int], slots: list[int], tables: torch.Tensor,
               window: int) -> torch.Tensor:
    """float64 attention with transformers' rule: position i sees keys j, i - window < j <= i."""
    flat_k = k_cache.clone().view(-1, *k.shape[1:]).double()
    flat_v = v_cache.clone().view(-1, *v.shape[1:]).double()
    flat_k[slots], flat_v[slots] = k.double(), v.double()
    groups = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (q_len, seq_len) in enumerate(seqs):
        pos = torch.arange(seq_len)
        rows = tables[i, pos // BS] * BS + pos % BS
        keys = flat_k[rows].repeat_interleave(groups, 1)
        values = flat_v[rows].repeat_interleave(groups, 1)
        for t in range(q_len):
            at = seq_len - q_len + t
            visible = (pos <= at) & (pos > at - window)
            scores = torch.einsum("hd,jhd->hj", q[qsl[i] + t].double(), keys[visible]) / math.sqrt(q.shape[2])
            out[qsl[i] + t] = torch.einsum("hj,jhd->hd", scores.softmax(-1), values[visible])
    return out


# ----------------------------------------------------------------------------- models end to end


@pytest.fixture(scope="module")
def sliding_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Mistral (window 16 on every layer), Qwen2 (window 14 on every layer: not a multiple of
    the block size), Qwen2 with its first layer full (nothing may be freed)."""
    root = tmp_path_factory.mktemp("sliding")
    return {
        "mistral": make_model(str(root / "mistral"), "mistral", seed=41, sliding_window=WINDOW, **MODEL_KW),
        "qwen2": make_model(str(root / "qwen2"), "qwen2", seed=42, sliding_window=WINDOW - 2, **MODEL_KW),
        "qwen2-mixed": make_model(str(root / "qwen2m"), "qwen2", seed=43, sliding_window=WINDOW, **MODEL_KW,
                                  config_overrides=dict(max_window_layers=1)),
    }


@pytest.fixture(params=["cpu", "torch"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The C-kernel backend, or the torch ops alone (what GPUs without Triton and other dtypes run)."""
    if request.param == "torch":
        monkeypatch.setenv("TIDAL_CPU_KERNELS", "0")
        monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", "torch")
        cpu_kernels.cache_clear()
    yield request.param
    cpu_kernels.cache_clear()


def _prompts(seed: int) -> dict[str, list[int]]:
    """Prompts 2.5 windows long sharing a 1.5-window prefix (prefix-cache hits past the window)."""
    rng = random.Random(seed)
    prefix = random_prompt(rng, 24)
    return {f"r{i}": prefix + random_prompt(rng, 16) for i in range(5)} | {"solo": random_prompt(rng, 41)}


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen2-mixed"])
def test_greedy_and_prompt_logprobs_match_transformers(sliding_models: dict[str, str], name: str,
                                                       backend: str) -> None:
    """Prompts of 40 tokens and 40 outputs (5 windows), chunked prefill (12-token steps, so
    chunks read cached context), prefix caching with hits past the window, and a pool of 21
    blocks: 6 full-context requests would need 120, and with windows they still need more than
    21, so requests are preempted and recomputed from cache hits."""
    path = sliding_models[name]
    prompts = _prompts(seed=len(name))
    core = make_core(path, block_size=BS, max_num_batched_tokens=12, max_model_len=84, num_kv_blocks=21,
                     enable_prefix_caching=True, disable_log_stats=False)
    try:
        first = run_to_completion(core, [req("warm", prompts["r0"], greedy(2))])  # caches the prefix
        reqs = [req(rid, p, greedy(40, prompt_logprobs=2 if rid == "solo" else None)) for rid, p in prompts.items()]
        run = run_to_completion(core, reqs)
        assert_all_blocks_free(core)
        kv = core.scheduler.kv_cache_manager
    finally:
        core.shutdown()
    assert kv.sliding_window == (None if name == "qwen2-mixed" else layer_sliding_windows(_config(path))[0])
    assert run.stats.num_preemptions > 0 and run.stats.prefix_cache_hits > first.stats.prefix_cache_hits
    assert run["r1"].num_cached_tokens >= 16  # a hit on the shared prefix, past the window
    for rid, prompt in prompts.items():
        assert_greedy_equal(run[rid].tokens, hf_generate(path, prompt, 40), f"{name} {rid}")
    solo = prompts["solo"]
    plp = run["solo"].prompt_logprobs
    assert plp is not None
    check_logprobs(plp, hf_log_softmax(path, solo)[:-1], solo[1:], 2, what=f"{name} prompt_logprobs")


def _config(path: str) -> SimpleNamespace:
    with open(os.path.join(path, "config.json")) as f:
        return SimpleNamespace(**json.load(f))


def test_triton_backend_end_to_end(sliding_models: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend (interpreted on CPU) through the engine: a prompt twice the window,
    decoded past 4 windows, chunked on cached context."""
    pytest.importorskip("triton")
    from tidal.worker import attention_triton
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(attention_triton._attention_kernel, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET (on CPU)")
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", "triton")
    path = sliding_models["mistral"]
    prompt = random_prompt(random.Random(9), 2 * WINDOW)
    core = make_core(path, block_size=BS, max_num_batched_tokens=12, max_model_len=84, num_kv_blocks=21)
    try:
        run = run_to_completion(core, [req("t", prompt, greedy(2 * WINDOW + 2))])
    finally:
        core.shutdown()
    assert_greedy_equal(run["t"].tokens, hf_generate(path, prompt, 2 * WINDOW + 2), "triton")


def test_llm_with_prefix_caching_and_preemption(sliding_models: dict[str, str]) -> None:
    """The public API: LLM (engine core in its own process) on Mistral with its window."""
    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    path = sliding_models["mistral"]
    prompts = _prompts(seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    with LLM(model=path, dtype="float32", block_size=BS, max_num_batched_tokens=12, max_model_len=84,
             num_kv_blocks=21, enable_prefix_caching=True, disable_log_stats=False) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts.values()], params, use_tqdm=False)
        stats = llm.get_stats()
    for (rid, prompt), out in zip(prompts.items(), outs):
        assert_greedy_equal(list(out.outputs[0].token_ids), hf_generate(path, prompt, 40), f"LLM {rid}")
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0


# ----------------------------------------------------------------------------- KV blocks held


def test_prefix_hit_needs_only_the_last_window() -> None:
    """Blocks behind the window go back to the pool still cached; once the early ones are
    evicted, a request with the same prefix still hits up to where the last window's blocks
    are cached, holds only those, and every reference count stays exact."""
    from tidal.core.kv_cache_manager import SKIPPED_ID, WORKER_SKIPPED_ID, KVCacheManager
    from tidal.core.request import Request
    from tidal.protocol import SamplingParams

    def request(rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, SamplingParams(max_tokens=4), eos_token_id=None, max_model_len=64)

    def check_refs(kv: KVCacheManager) -> None:
        refs = [0] * kv.num_blocks
        for rid in kv.req_to_blocks:
            for i in kv.held_block_ids(rid):
                refs[i] += 1
        assert kv.block_pool.ref_counts() == refs and kv.num_free_blocks == refs.count(0)

    kv = KVCacheManager(num_blocks=12, block_size=4, sliding_window=8)
    a = request("a", list(range(10, 40)))  # 30 tokens, 8 blocks
    assert kv.allocate_slots(a, 30, [], 0) is not None
    a.num_computed_tokens = 30
    kv.cache_blocks(a, 30)  # 7 full blocks cached
    a_ids = kv.get_block_ids("a")
    assert kv.allocate_slots(a, 1) == []  # the decode at 30 reads 23.. : blocks 0-4 released
    assert kv.held_block_ids("a") == a_ids[5:] and kv.get_block_ids("a")[:5] == [WORKER_SKIPPED_ID] * 5
    check_refs(kv)
    c = request("c", list(range(100, 120)))
    assert kv.allocate_slots(c, 20, [], 0) is not None  # 4 never-used blocks, then evicts a's block 4
    assert a_ids[4] in kv.held_block_ids("c")
    b = request("b", list(range(10, 38)) + [7, 7, 7])
    hit_ids, num_hit = kv.get_computed_blocks(b)
    # Block 4 is gone, but the hit at 28 tokens needs positions 21.. only: blocks 5 and 6.
    assert num_hit == 28 and hit_ids == [SKIPPED_ID] * 5 + a_ids[5:7]
    assert kv.allocate_slots(b, 3, hit_ids, num_hit) is not None
    assert kv.get_block_ids("b")[:7] == [WORKER_SKIPPED_ID] * 5 + a_ids[5:7]
    check_refs(kv)
    assert kv.block_pool.blocks[a_ids[5]].ref_cnt == 2  # shared, so never handed out
    for r in (a, b, c):
        kv.free(r)
    check_refs(kv)
    assert kv.num_free_blocks == kv.num_blocks


def test_blocks_held_stay_flat_at_4x_the_window(tmp_path: Any) -> None:
    """A request decoded to 4x the window holds at most window/block_size + 1 blocks, the same
    at 2x as at 4x; the blocks it drops serve a second request at once. With full-context KV
    the two (64 tokens each, 16 blocks each) could not share the 16-block pool without
    preemption. The null runner: only the engine core's block accounting is under test."""
    config = dict(architectures=["MistralForCausalLM"], num_hidden_layers=2, sliding_window=WINDOW, vocab_size=512,
                  max_position_embeddings=4 * WINDOW)
    (tmp_path / "config.json").write_text(json.dumps(config))
    core = make_core(str(tmp_path), model_runner="null", block_size=BS, max_num_batched_tokens=WINDOW,
                     max_model_len=4 * WINDOW, num_kv_blocks=4 * WINDOW // BS, disable_log_stats=False)
    kv = core.scheduler.kv_cache_manager
    held: dict[str, list[list[int]]] = {"a": [], "b": []}
    allocate = kv.allocate_slots

    def allocate_and_record(request: Any, *args: Any) -> list[int] | None:
        new_ids = allocate(request, *args)
        held[request.request_id].append(kv.held_block_ids(request.request_id))
        return new_ids

    kv.allocate_slots = allocate_and_record  # type: ignore[method-assign]
    try:
        run = run_to_completion(core, [req("a", list(range(3, 3 + WINDOW)), greedy(3 * WINDOW))],
                                joins={2 * WINDOW: [req("b", list(range(5, 5 + WINDOW)), greedy(3 * WINDOW))]})
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
    assert [len(run[r].tokens) for r in "ab"] == [3 * WINDOW] * 2
    assert run.stats.num_preemptions == 0
    for rid, steps in held.items():  # from 2x to 4x the window: between W/bs and W/bs + 1
        sizes = [len(ids) for ids in steps]
        assert max(sizes) <= WINDOW // BS + 1, (rid, sizes)
        assert min(sizes[WINDOW:]) >= WINDOW // BS, (rid, sizes)
    dropped_by_a = set().union(*held["a"]) - set(held["a"][-1])
    assert dropped_by_a & set().union(*held["b"]), "b never got a block a had released"


# ----------------------------------------------------------------------------- disable_sliding_window

def test_disable_sliding_window_is_full_attention_capped_at_the_window(sliding_models: dict[str, str]) -> None:
    """vLLM's disable_sliding_window: every layer attends the full context, and the context is
    capped at the window (what the model was trained to attend); asking for more is refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tidal.frontend import LLM
    from tidal.protocol import SamplingParams

    path = sliding_models["mistral"]
    with pytest.raises(ValueError, match=f"max_position_embeddings {WINDOW}"):
        LLM(model=path, disable_sliding_window=True, max_model_len=WINDOW + 1)
    prompt = list(range(5, 5 + WINDOW - 4))
    cfg = AutoConfig.from_pretrained(path)
    cfg.sliding_window = None  # transformers' full-attention Mistral of the same weights
    hf = AutoModelForCausalLM.from_pretrained(path, config=cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
    with LLM(model=path, dtype="float32", disable_sliding_window=True, multiprocessing=False) as llm:
        assert llm.llm_engine.model_config.max_model_len == WINDOW
        assert llm.llm_engine.model_config.get_sliding_window() is None
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert list(out[0].outputs[0].token_ids) == expected[0, len(prompt):].tolist()
