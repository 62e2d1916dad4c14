"""The engine on a CUDA device, against transformers on the same device (issue 14, "GPU tests").

Every test is marked `gpu` and skipped without CUDA; scripts/device_check.sh runs them on the
lent GPU machine (`python -m pytest -m gpu tests/test_gpu.py`). TIDAL_GPU_TESTS_ON_CPU=1 runs
the same tests with device="cpu" (a sanity check of the tests themselves; the CUDA-only
assertions - graph replays, memory-sized KV cache - are skipped there).

Models are tiny random checkpoints made on the spot, with head dims the Triton kernels serve
(64, 128). The engine core runs in this process (the worker too: tensor_parallel_size=1), so
scheduler stats and schedules are read directly, as tests/test_engine_features.py does.
"""
from __future__ import annotations

import contextlib
import gc
import os
import random
from typing import Any, Iterator

import pytest
import torch

from engine_utils import Ref, assert_greedy_equal, greedy, hf_generate, make_core, req, run_to_completion
from tidal.protocol import SamplingParams

ON_CPU = os.environ.get("TIDAL_GPU_TESTS_ON_CPU") == "1"
DEV = "cpu" if ON_CPU else "cuda"

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(),
                       reason="needs a CUDA device (TIDAL_GPU_TESTS_ON_CPU=1 runs these on the CPU)"),
]

# name -> (arch, make_model kwargs); vocab 512 unless given. One per architecture family.
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2,  # head_dim 64, untied
                            seed=41)),
    "qwen2": ("qwen2", dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=1,  # MQA, qkv bias, tied
                            seed=42)),
    "qwen3": ("qwen3", dict(hidden_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=128,
                            tie_word_embeddings=False, seed=43)),  # q/k norm, heads*head_dim != hidden
    # vocab 4096: seeded sampling runs the sampler's 2-level race (tokenizer borrowed from qwen3)
    "qwen3-4k": ("qwen3", dict(vocab_size=4096, hidden_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
                               head_dim=64, seed=44, tokenizer_from="qwen3")),
}
CORE_DEFAULTS = dict(device=DEV, max_num_seqs=32, max_model_len=256, block_size=16, num_kv_blocks=256)


@pytest.fixture(scope="module")
def paths(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> dict[str, str]:
    from tidal.frontend.entrypoints.make_model import make_model

    out: dict[str, str] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        for name, (arch, kwargs) in MODELS.items():
            kwargs = dict(kwargs)
            if "tokenizer_from" in kwargs:
                kwargs["tokenizer_dir"] = out[kwargs.pop("tokenizer_from")]
            out[name] = make_model(str(tmp_path_factory.mktemp(name)), arch, **kwargs)
    return out


@contextlib.contextmanager
def core_on(path: str, **kwargs: Any) -> Iterator[Any]:
    """An in-process EngineCore on DEV; shut down and its device memory released after."""
    core = make_core(path, **{**CORE_DEFAULTS, **kwargs})
    try:
        yield core
    finally:
        core.shutdown()
        del core
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


@contextlib.contextmanager
def exact_fp32() -> Iterator[None]:
    """transformers' reference in true float32 (no TF32 matmuls), whatever the engine set."""
    if not torch.cuda.is_available():
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


_hf: dict[tuple[str, torch.dtype], Any] = {}


def hf_on_device(path: str, dtype: torch.dtype = torch.float32) -> Any:
    from transformers import AutoModelForCausalLM

    if (path, dtype) not in _hf:
        m = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEV).eval()
        m.generation_config.eos_token_id = None  # ignore_eos
        m.generation_config.pad_token_id = 0
        _hf[(path, dtype)] = m
    return _hf[(path, dtype)]


def hf_greedy(path: str, prompt: list[int], n: int) -> Ref:
    """transformers greedy `generate` in float32 on DEV, with the logits each token came from."""
    ids = torch.tensor([prompt], device=DEV)
    with torch.no_grad(), exact_fp32():
        g = hf_on_device(path).generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                        max_new_tokens=n, output_scores=True, return_dict_in_generate=True)
    return Ref(g.sequences[0, len(prompt):].tolist(), torch.stack(g.scores)[:, 0].float().cpu())


def hf_token_logprobs(path: str, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    """[len(tokens) - 1]: log p(tokens[p] | tokens[:p]) for p >= 1, transformers in `dtype` on DEV."""
    with torch.no_grad(), exact_fp32():
        logits = hf_on_device(path, dtype)(torch.tensor([tokens], device=DEV)).logits[0].float()
    lp = torch.log_softmax(logits[:-1], -1)
    return lp.gather(1, torch.tensor(tokens[1:], device=DEV)[:, None])[:, 0].cpu()


def robust_prompts(path: str, seed: int, lengths: list[int], max_tokens: int, prefix: list[int] = ()) -> list[list[int]]:
    """prefix + random prompts whose float32 greedy continuation has no top-2 logit gap under
    1e-3 (so a greedy comparison never hinges on float noise; engine_utils.robust_prompt, vocab
    of the model)."""
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    rng = random.Random(seed)
    out = []
    for n in lengths:
        for _ in range(50):
            p = list(prefix) + [rng.randrange(3, vocab) for _ in range(n)]
            if min(hf_generate(path, p, max_tokens).gaps) >= 1e-3:
                out.append(p)
                break
        else:
            raise AssertionError(f"no prompt without a near-tie for {path}")
    return out


class ReplayCounter:
    """Counts torch.cuda.CUDAGraph.replay calls (how the engine's CUDA graphs run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        if torch.cuda.is_available():
            original = torch.cuda.CUDAGraph.replay

            def replay(graph: Any, *args: Any, **kwargs: Any) -> Any:
                self.count += 1
                return original(graph, *args, **kwargs)

            monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)


# ------------------------------------------------------------------ parity with transformers


def count_triton_attention_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """[calls of the Triton attention backend's forward], counted from now on (CUDA only: on
    the CPU the C-kernel backend runs)."""
    calls = [0]
    if not ON_CPU:
        from tidal.worker.attention_triton import TritonAttentionBackend

        original = TritonAttentionBackend.forward

        def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
            calls[0] += 1
            return original(self, *args, **kwargs)

        monkeypatch.setattr(TritonAttentionBackend, "forward", forward)
    return calls


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_greedy_fp32_equals_transformers(paths: dict[str, str], name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of prompts of different lengths (several blocks, a partial last block), greedy,
    float32: token for token what transformers gives on the same device, with the Triton
    attention backend (the default on CUDA) doing the attention."""
    path = paths[name]
    prompts = robust_prompts(path, 1, [5, 17, 33, 70], 24)
    refs = [hf_greedy(path, p, 24) for p in prompts]
    triton_calls = count_triton_attention_calls(monkeypatch)
    with core_on(path, dtype="float32") as core:
        run = run_to_completion(core, [req(f"r{i}", p, greedy(24)) for i, p in enumerate(prompts)])
    for i, ref in enumerate(refs):
        assert_greedy_equal(run[f"r{i}"].tokens, ref, f"{name} r{i}")
    if not ON_CPU:
        assert triton_calls[0] > 0, "the Triton attention backend did not run on CUDA"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_bf16_within_transformers_bf16_distance(paths: dict[str, str], name: str) -> None:
    """bfloat16 weights and KV cache: the logprobs of every prompt token (prefill) and of every
    greedy token (decode) are as close to float32 transformers as transformers' own bfloat16
    run of the same checkpoint is (max abs difference; x2 because a max over ~100 positions of
    two independent roundings is a noisy statistic - both numbers are in the message)."""
    path = paths[name]
    prompt = robust_prompts(path, 2, [40], 8)[0]
    with core_on(path, dtype="bfloat16") as core:
        params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0, prompt_logprobs=0)
        r = run_to_completion(core, [req("r", prompt, params)])["r"]
    tokens = prompt + r.tokens
    engine_lp = torch.cat([torch.as_tensor(r.prompt_logprobs.logprobs)[:, 0],
                           torch.as_tensor(r.logprobs.logprobs)[:, 0]]).float()
    assert engine_lp.shape == (len(tokens) - 1,), engine_lp.shape
    ref = hf_token_logprobs(path, tokens, torch.float32)
    hf_distance = float((hf_token_logprobs(path, tokens, torch.bfloat16) - ref).abs().max())
    distance = float((engine_lp - ref).abs().max())
    assert torch.isfinite(engine_lp).all()
    assert 0 < distance <= 2 * hf_distance, (name, distance, hf_distance)


# ------------------------------------------------------------------ CUDA graphs


def test_graphs_on_equal_graphs_off(paths: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """20 requests whose lengths make the decode batch shrink 20 -> 1 (graph buckets 24, 16,
    8, 4, 2, 1 with padded rows), greedy and seeded sampling: enforce_eager=False gives token
    for token what enforce_eager=True gives, and greedy equals transformers. On CUDA, the
    graphs-on run must replay CUDA graphs and the eager one none."""
    path = paths["qwen3"]
    prompts = robust_prompts(path, 3, [3 + 7 * i for i in range(20)], 4 + 20)
    reqs = [req(f"g{i}", p, greedy(4 + i)) if i % 2 == 0 else
            req(f"s{i}", p, SamplingParams(temperature=0.8, top_p=0.95, seed=100 + i, max_tokens=4 + i,
                                           ignore_eos=True))
            for i, p in enumerate(prompts)]
    counter = ReplayCounter(monkeypatch)
    runs, replays = {}, {}
    for eager in (True, False):
        counter.count = 0
        with core_on(path, dtype="float32", enforce_eager=eager) as core:
            runs[eager] = run_to_completion(core, reqs)
        replays[eager] = counter.count
    assert runs[False].tokens() == runs[True].tokens()
    for i, p in enumerate(prompts[::2]):
        assert_greedy_equal(runs[False][f"g{2 * i}"].tokens, hf_greedy(path, p, 4 + 2 * i), f"g{2 * i}")
    if not ON_CPU:
        assert replays[True] == 0, replays
        assert replays[False] > 0, f"graphs on, but no CUDA graph was replayed: {replays}"


# ------------------------------------------------------------------ scheduler features on the device


def test_chunked_prefill_on_device(paths: dict[str, str]) -> None:
    """max_num_batched_tokens=20 splits every prompt into chunks that end inside a block and run
    beside other requests' decodes; greedy tokens equal transformers'."""
    path = paths["llama"]
    prompts = robust_prompts(path, 4, [45, 61, 30], 10)
    with core_on(path, dtype="float32", max_num_batched_tokens=20) as core:
        run = run_to_completion(core, [req(f"c{i}", p, greedy(10)) for i, p in enumerate(prompts)])
    first_chunk = {rid: s.num_scheduled_tokens[rid] for s in reversed(run.steps) for rid in s.new_reqs}
    assert all(first_chunk[f"c{i}"] < len(p) for i, p in enumerate(prompts)), first_chunk
    assert run.mixed_steps(), "no step ran a prefill chunk beside a decode"
    assert max(s.total for s in run.steps) <= 20
    for i, p in enumerate(prompts):
        assert_greedy_equal(run[f"c{i}"].tokens, hf_greedy(path, p, 10), f"c{i}")


def test_prefix_cache_hits_on_device(paths: dict[str, str]) -> None:
    """A second request sharing a 3-block prefix reads it from the cache (hits counted, its
    prefill starts after the prefix) and still gives transformers' tokens."""
    path, bs = paths["qwen2"], 16
    prefix = robust_prompts(path, 5, [3 * bs], 6)[0]
    a, b = robust_prompts(path, 6, [9, 14], 12, prefix)
    with core_on(path, dtype="float32", block_size=bs) as core:
        run_a = run_to_completion(core, [req("A", a, greedy(12))])
        run_b = run_to_completion(core, [req("B", b, greedy(12))])
    assert run_a["A"].num_cached_tokens == 0
    assert run_b["B"].num_cached_tokens == 3 * bs
    assert run_b.stats.prefix_cache_hits - run_a.stats.prefix_cache_hits == 3 * bs
    assert [s.num_scheduled_tokens["B"] for s in run_b.steps if "B" in s.new_reqs] == [len(b) - 3 * bs]
    assert_greedy_equal(run_a["A"].tokens, hf_greedy(path, a, 12), "A")
    assert_greedy_equal(run_b["B"].tokens, hf_greedy(path, b, 12), "B")


def test_preemption_on_device(paths: dict[str, str]) -> None:
    """An 8-block pool for four requests that need 5 blocks each: requests are preempted and
    recomputed, and every one still gives transformers' greedy tokens (the same as a roomy pool)."""
    path = paths["qwen3"]
    prompts = robust_prompts(path, 7, [40, 38, 42, 41], 40)
    reqs = [req(f"p{i}", p, greedy(40)) for i, p in enumerate(prompts)]
    runs = {}
    for blocks in (8, 64):
        with core_on(path, dtype="float32", num_kv_blocks=blocks, max_model_len=128) as core:
            runs[blocks] = run_to_completion(core, reqs)
    assert runs[8].stats.num_preemptions > 0 and runs[64].stats.num_preemptions == 0
    assert runs[8].tokens() == runs[64].tokens()
    for i, p in enumerate(prompts):
        assert_greedy_equal(runs[8][f"p{i}"].tokens, hf_greedy(path, p, 40), f"p{i}")


def test_seeded_sampling_independent_of_batch_neighbours(paths: dict[str, str]) -> None:
    """A seeded request (temperature, top-k, top-p; vocab 4096) gives the same tokens alone and
    in a batch of 7 others (seeded and not, joining at different steps), graphs on."""
    path = paths["qwen3-4k"]
    rng = random.Random(8)
    target = [rng.randrange(3, 4096) for _ in range(37)]
    params = SamplingParams(temperature=0.9, top_k=200, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True)
    others = [req(f"o{i}", [rng.randrange(3, 4096) for _ in range(5 + 11 * i)],
                  SamplingParams(temperature=1.0, seed=None if i % 2 else i, max_tokens=8 + 5 * i, ignore_eos=True))
              for i in range(7)]
    with core_on(path, dtype="float32") as core:
        alone = run_to_completion(core, [req("T", target, params)])["T"].tokens
        # the prefix cache would let the second run skip the prompt: start it from nothing
        assert core.scheduler.reset_prefix_cache()
        crowd = run_to_completion(core, others[:4] + [req("T", target, params)],
                                  joins={2: others[4:6], 5: others[6:]})
    assert len(alone) == 32
    assert crowd["T"].tokens == alone
    assert len({tuple(crowd[f"o{i}"].tokens[:8]) for i in range(7)}) > 1  # they did sample


# ------------------------------------------------------------------ KV cache sized from memory


@pytest.mark.skipif(ON_CPU, reason="gpu_memory_utilization applies to CUDA devices")
def test_kv_cache_sized_from_device_memory(paths: dict[str, str]) -> None:
    """No num_kv_blocks: the pool comes from gpu_memory_utilization (capped at what
    max_num_seqs sequences of max_model_len can use); a share too small for one sequence is a
    ValueError, not an out-of-memory later."""
    path = paths["qwen3"]
    with core_on(path, dtype="bfloat16", num_kv_blocks=None, gpu_memory_utilization=0.5) as core:
        assert core.info.num_kv_blocks >= CORE_DEFAULTS["max_model_len"] // 16
        run = run_to_completion(core, [req("m", list(range(3, 40)), greedy(8))])
        assert len(run["m"].tokens) == 8
    with pytest.raises(ValueError), core_on(path, dtype="bfloat16", num_kv_blocks=None, gpu_memory_utilization=0.001):
        pass
