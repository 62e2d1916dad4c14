"""CPU graphs (worker/cpu_graphs.py): small decode batches replay recorded kernel calls.

- For each architecture family, the engine with graphs gives exactly the tokens and logprobs of
  enforce_eager=True (no graphs), greedy and seeded, with batches shrinking from 5 (eager:
  larger than any captured size) through 3 (padded to 4) to 1, and graphs really replayed.
- The capture refuses what a recording cannot replay -- a host read of a tensor, a tensor made
  from Python data, a kernel reached other than through cpu_kernels() -- and the model then
  runs eagerly.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from engine_utils import step_outputs
from tidal.core.engine_core import EngineCore
from tidal.protocol import EngineConfig, SamplingParams
from tidal.protocol.messages import EngineCoreRequest
from tidal.worker.cpu_graphs import CaptureRefused, CpuGraphRunner, capture_cpu_graphs
from tidal.worker.cpu_kernels import cpu_kernels, ptr
from tidal.worker.input_batch import InputBatch

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels are not built here")

MODELS: dict[str, dict[str, Any]] = {
    "llama": dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512, seed=1),
    "qwen3": dict(arch="qwen3", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=1, vocab_size=512, seed=2),
    "mistral-window": dict(arch="mistral", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                           vocab_size=512, seed=3, sliding_window=12),
    "gemma2": dict(arch="gemma2", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
                   seed=4, sliding_window=12),
    "qwen3-moe": dict(arch="qwen3_moe", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      vocab_size=512, seed=5, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2),
}
# Every dense family must be recorded (one that stops being recordable is a regression); an
# MoE layer groups tokens by the experts the router picks, on the host: it must refuse.
UNRECORDABLE = {"qwen3-moe"}
MAX_TOKENS = [8, 14, 20, 26, 34]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, tidal_cache_dir: str) -> dict[str, str]:
    from tidal.frontend.entrypoints.make_model import make_model

    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        for name, kw in MODELS.items():
            kw = dict(kw)
            out[name] = make_model(str(tmp_path_factory.mktemp(f"graphs-{name}")), kw.pop("arch"), **kw)
    return out


def _run(model: str, eager: bool, kv_cache_dtype: str = "auto") -> tuple[dict[str, list[int]], list[float], int]:
    core = EngineCore(EngineConfig(model=model, dtype="float32", device="cpu", max_model_len=128, block_size=4,
                                   enforce_eager=eager, kv_cache_dtype=kv_cache_dtype))
    try:
        graphs = core.executor.worker.model_runner.cpu_graphs
        assert (graphs is None) == (eager or any(model.endswith(f"graphs-{n}0") for n in UNRECORDABLE))
        for i, n in enumerate(MAX_TOKENS):
            seeded = i % 2 == 1
            core.add_request(EngineCoreRequest(f"r{i}", [20 + (7 * i * k + 3 * k) % 480 for k in range(3 + 5 * i)],
                                               SamplingParams(max_tokens=n, temperature=0.8 if seeded else 0.0,
                                                              seed=i if seeded else None, logprobs=2,
                                                              ignore_eos=True)))
        tokens: dict[str, list[int]] = {}
        logprobs: list[float] = []
        for _ in range(500):
            if not core.has_unfinished_requests():
                break
            for out in step_outputs(core):
                assert out.error is None, out.error
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    logprobs.extend(out.new_logprobs.logprobs.ravel().tolist())
        assert not core.has_unfinished_requests()
        return tokens, logprobs, 0 if graphs is None else graphs.replays
    finally:
        core.shutdown()


@pytest.mark.parametrize("name", list(MODELS))
def test_graphs_give_the_eager_tokens_and_logprobs(model_dirs: dict[str, str], name: str) -> None:
    tokens, logprobs, replays = _run(model_dirs[name], eager=False)
    ref_tokens, ref_logprobs, _ = _run(model_dirs[name], eager=True)
    assert {k: len(v) for k, v in tokens.items()} == {f"r{i}": n for i, n in enumerate(MAX_TOKENS)}
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-6)
    # batches of 4 down to 1 decode through the graphs: at least the last request's lone steps
    assert replays >= (0 if name in UNRECORDABLE else MAX_TOKENS[-1] - MAX_TOKENS[-2])


def test_half_precision_kv_cache(model_dirs: dict[str, str]) -> None:
    tokens, _, replays = _run(model_dirs["llama"], eager=False, kv_cache_dtype="bfloat16")
    assert replays > 0
    assert tokens == _run(model_dirs["llama"], eager=True, kv_cache_dtype="bfloat16")[0]


# ---------------------------------------------------------------- refusals
def _input_batch() -> InputBatch:
    ib = InputBatch(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=4,
                    device=torch.device("cpu"))
    ib.num_blocks = 8
    return ib


class _Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(32, 8)


class _ReadsOnHost(_Embed):
    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        return h * 2 if float(h.sum()) > 0 else h  # the branch a recording would freeze


class _TensorFromPython(_Embed):
    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(ids) + torch.tensor([1.0])


class _HiddenKernel(_Embed):
    """Calls a C kernel through a function object it kept: invisible to the recording."""

    def __init__(self) -> None:
        super().__init__()
        self.silu_and_mul = cpu_kernels().tidal_silu_and_mul_f32

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        out = h.new_empty(h.shape[0], h.shape[1] // 2)
        self.silu_and_mul(ptr(h), ptr(out), h.shape[0], h.shape[1] // 2)
        return out


class _Plain(_Embed):
    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(ids)
        out = h.new_empty(h.shape[0], h.shape[1] // 2)
        cpu_kernels().tidal_silu_and_mul_f32(ptr(h), ptr(out), h.shape[0], h.shape[1] // 2)
        return out


@pytest.mark.parametrize("model_cls, why", [
    (_ReadsOnHost, "reads a tensor's value on the host"),
    (_TensorFromPython, "makes a tensor from Python data"),
    (_HiddenKernel, "differs from the eager forward"),
])
def test_capture_refuses_what_it_cannot_replay(model_cls: type[nn.Module], why: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="tidal.worker.cpu_graphs"), torch.inference_mode():
        assert capture_cpu_graphs(model_cls(), _input_batch(), max_num_seqs=4, max_model_len=64) is None
    assert why in caplog.text and "decodes run eagerly" in caplog.text


def test_a_recordable_model_replays_its_inputs() -> None:
    model = _Plain()
    ib = _input_batch()
    with torch.inference_mode():
        runner = capture_cpu_graphs(model, ib, max_num_seqs=4, max_model_len=64)
        assert runner is not None and sorted(runner.graphs) == [1, 2, 4]
        ib.prepare([], [], [], [], pad_to=2)
        ib.input_ids.np[:2] = [5, 17]
        out = runner.replay(2, 2).clone()
        h = model.model.embed_tokens(torch.tensor([5, 17]))
        ref = torch.nn.functional.silu(h[:, :4]) * h[:, 4:]
    torch.testing.assert_close(out, ref)


def test_a_size_past_the_step_buffers_is_refused() -> None:
    """Capturing a size the buffers do not hold would reallocate them under the sizes already
    captured (whose replays would then read and write freed memory): refused, not captured."""
    ib = InputBatch(max_num_seqs=2, max_num_batched_tokens=16, max_model_len=64, block_size=4,
                    device=torch.device("cpu"))
    ib.num_blocks = 8
    with torch.inference_mode(), pytest.raises(CaptureRefused, match="reallocated"):
        CpuGraphRunner(_Plain(), ib, [1, 2, 4], max_model_len=64).capture()
