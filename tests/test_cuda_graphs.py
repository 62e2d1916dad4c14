"""CUDA-graph logic that runs without a GPU (worker/cuda_graphs.py): the capture sizes, the
padded size a batch replays with, the metadata a graph is captured over, and a replay
stand-in that runs the model eagerly over the padded persistent buffers exactly as a graph
would read them, which must sample what the eager path samples. Capture itself needs CUDA;
on CPU `capture_cuda_graphs` is a logged no-op."""
from __future__ import annotations

import os

import torch

# Without a GPU the Triton test below runs the kernels under the interpreter, which must be
# chosen before triton decorates them (as tests/test_triton_attention.py does; it stays set
# for the session). With one, the kernels must compile for real (graphs are captured).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import logging  # noqa: E402
import random  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tidal.core.request import Request  # noqa: E402
from tidal.core.scheduler import Scheduler  # noqa: E402
from tidal.protocol import SamplingParams  # noqa: E402
from tidal.worker.attention_metadata import AttentionMetadata  # noqa: E402
from tidal.worker.cuda_graphs import CudaGraphRunner, backend_is_graph_safe, capture_sizes, padded_size  # noqa: E402
from tidal.worker.forward_context import set_forward_context  # noqa: E402
from tidal.worker.input_batch import InputBatch  # noqa: E402
from tidal.worker.model_runner import ModelRunner  # noqa: E402

BS = 4


def reference_sizes(cap: int) -> list[int]:
    sizes = []
    s = 1
    while s < 8:  # 1, 2, 4
        if s < cap:
            sizes.append(s)
        s *= 2
    s = 8
    while s < cap:
        sizes.append(s)
        s += 8 if s < 256 else 16
    return sizes + [cap]


@pytest.mark.parametrize("max_num_seqs", [1, 2, 3, 4, 5, 8, 9, 16, 100, 248, 255, 256, 257, 272, 300, 512, 1024])
def test_capture_sizes_follow_vllm_grid(max_num_seqs: int) -> None:
    sizes = capture_sizes(max_num_seqs)
    assert sizes == reference_sizes(max_num_seqs)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_num_seqs


def test_capture_sizes_examples_and_overrides() -> None:
    assert capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(256)[-3:] == [240, 248, 256]
    assert capture_sizes(300)[-4:] == [256, 272, 288, 300]
    assert len(capture_sizes(256)) == 35
    assert capture_sizes(512, max_num_tokens=64)[-1] == 64  # the token buffers cap it too
    assert capture_sizes(0) == []
    # A user's list replaces the grid: sorted, deduplicated, within [1, cap].
    assert capture_sizes(64, [16, 1, 8, 8, 128, 0, 64]) == [1, 8, 16, 64]
    assert capture_sizes(64, []) == []
    # Sizes above the cap (max_cudagraph_capture_size's grid beyond max_num_seqs) become the cap.
    assert capture_sizes(100, [1, 2, 4, *range(8, 513, 8)])[-2:] == [96, 100]


def test_padded_size() -> None:
    sizes = capture_sizes(256)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 249, 256)] == [1, 2, 4, 4, 8, 8, 16, 24, 256, 256]
    assert padded_size(257, sizes) is None
    assert padded_size(3, [1, 2]) is None and padded_size(1, []) is None
    for n in range(1, 257):
        p = padded_size(n, sizes)
        assert p is not None and p >= n and all(s < n for s in sizes if s < p)


def staged_batch(max_num_seqs: int = 8, max_tokens: int = 64, max_model_len: int = 64) -> InputBatch:
    return InputBatch(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_model_len,
                      block_size=BS, device=torch.device("cpu"), num_blocks=64, separate_staging=True)


def test_capture_metadata_views_the_persistent_buffers() -> None:
    ib = staged_batch()
    runner = CudaGraphRunner(torch.nn.Identity(), ib, [1, 2, 4, 8], max_model_len=64)
    assert runner.padded_size(3) is None  # nothing captured: eager
    meta = runner.decode_metadata(4)
    assert meta.max_query_len == 1 and meta.max_seq_len == 64 and meta.block_tables_checked
    assert meta.num_seqs == 4 and meta.num_tokens == 4 and meta.decode_seqs == [0, 1, 2, 3]
    assert meta.slot_mapping.data_ptr() == ib.slot_mapping.dev.data_ptr() and meta.slot_mapping.shape == (4,)
    assert meta.block_tables.data_ptr() == ib.step_table.data_ptr() and meta.block_tables.shape == (4, ib.max_blocks)
    assert meta.device_query_start_loc().data_ptr() == ib.query_start_loc.dev.data_ptr()
    assert meta.device_seq_lens().data_ptr() == ib.seq_lens.dev.data_ptr()
    ib.fill_dummy_decode(8)  # what the buffers hold while graphs are captured
    assert ib.input_ids.dev[:8].tolist() == [0] * 8 and ib.positions.dev[:8].tolist() == [0] * 8
    assert ib.slot_mapping.dev[:8].tolist() == [-1] * 8 and ib.seq_lens.dev[:8].tolist() == [1] * 8
    assert ib.query_start_loc.dev[:9].tolist() == list(range(9)) and not ib.step_table[:8].any()
    # Graphs read the buffers they were captured over: a reallocation drops them.
    runner.graphs[8] = (None, None)  # type: ignore[assignment]
    runner.generation = ib.generation
    assert runner.padded_size(5) == 8 and runner.padded_size(9) is None
    ib._grow(num_tokens=1000)
    assert runner.padded_size(5) is None and not runner.graphs


def test_no_capture_off_cuda(caplog: pytest.LogCaptureFixture) -> None:
    runner = ModelRunner(torch.nn.Identity(), block_size=BS, vocab_size=10, device=torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="tidal.worker.model_runner"):
        runner.capture_cuda_graphs()
    assert runner.cuda_graphs is None and "not captured" in caplog.text
    assert backend_is_graph_safe(torch.device("cpu")) == (False, "CpuAttentionBackend")


class EagerReplay(CudaGraphRunner):
    """A graph stand-in: 'replaying' size n runs the model over the buffers [:n] as filled
    (padding included). With `as_captured`, under the very metadata a graph of that size is
    captured with (host lists of a dummy batch, max_seq_len = max_model_len: only the device
    tensors carry the step), which a graph-safe backend must handle; otherwise with metadata
    rebuilt from what the buffers hold (for the CPU backends, which read the host lists)."""

    def __init__(self, model: torch.nn.Module, ib: InputBatch, sizes: list[int], max_model_len: int,
                 as_captured: bool = False) -> None:
        super().__init__(model, ib, sizes, max_model_len)
        self.graphs = {n: (None, None) for n in sizes}  # type: ignore[misc]
        self.generation = ib.generation
        self.replays: list[tuple[int, int]] = []
        self.as_captured = as_captured

    def replay(self, padded: int, num_tokens: int) -> torch.Tensor:
        ib = self.input_batch
        self.replays.append((num_tokens, padded))
        if self.as_captured:
            with set_forward_context(self.decode_metadata(padded)):
                return self.model(ib.input_ids.dev[:padded], ib.positions.dev[:padded])[:num_tokens]
        meta = AttentionMetadata.build(
            slot_mapping=ib.slot_mapping.dev[:padded],
            query_start_loc=ib.query_start_loc.dev[: padded + 1].tolist(),
            seq_lens=ib.seq_lens.dev[:padded].tolist(),
            block_tables=ib.step_table[:padded], block_size=ib.block_size)
        assert meta.max_query_len == 1
        with set_forward_context(meta):
            hidden = self.model(ib.input_ids.dev[:padded], ib.positions.dev[:padded])
        return hidden[:num_tokens]


def run_requests(model: torch.nn.Module, vocab: int, graphs: bool, *, num_reqs: int = 7, max_num_seqs: int = 7,
                 max_model_len: int = 96, max_tokens: tuple[int, int] = (4, 24), as_captured: bool = False,
                 sizes: list[int] | None = None) -> tuple[dict[str, list[int]], dict[str, list[float]], list[tuple[int, int]]]:
    """Requests through a scheduler and a runner with staged (CUDA-path) inputs; with `graphs`,
    decode steps 'replay' (EagerReplay) over the padded buffers."""
    rng = random.Random(3)
    num_blocks = max(40, max_model_len // BS)
    sched = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=48, block_size=BS, num_kv_blocks=num_blocks,
                      max_model_len=max_model_len)
    device = next(model.parameters()).device
    runner = ModelRunner(model, block_size=BS, vocab_size=vocab, device=device,
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=48, max_model_len=max_model_len)
    replays: list[tuple[int, int]] = []
    if device.type == "cuda":  # the real thing: captured graphs, replays counted
        runner.bind_kv_cache(num_blocks, torch.float32)
        if graphs:
            runner.capture_cuda_graphs(sizes)
            assert runner.cuda_graphs is not None and sorted(runner.cuda_graphs.graphs) == capture_sizes(
                max_num_seqs, sizes)
            replay_graph = runner.cuda_graphs.replay

            def counted(padded: int, num_tokens: int) -> torch.Tensor:
                replays.append((num_tokens, padded))
                return replay_graph(padded, num_tokens)

            runner.cuda_graphs.replay = counted  # type: ignore[method-assign]
    else:
        runner.input_batch = staged_batch(max_num_seqs, 48, max_model_len)
        runner.bind_kv_cache(num_blocks, torch.float32)
        if graphs:
            replay = EagerReplay(model, runner.input_batch, capture_sizes(max_num_seqs, sizes), max_model_len,
                                 as_captured)
            runner.cuda_graphs = replay
            replays = replay.replays
    for i in range(num_reqs):
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 30))]
        sp = SamplingParams(max_tokens=rng.randint(*max_tokens), ignore_eos=True, temperature=0.0 if i % 2 else 1.0,
                            seed=i, logprobs=1)
        sched.add_request(Request(f"r{i}", prompt, sp, max_model_len=max_model_len))
    tokens: dict[str, list[int]] = {}
    lps: dict[str, list[float]] = {}
    while sched.has_unfinished_requests():
        so = sched.schedule()
        out = runner.execute_model(so)
        for rid, t in zip(out.req_ids, out.sampled_token_ids):
            tokens.setdefault(rid, []).extend(t)
        for rid, a in out.logprobs.items():
            lps.setdefault(rid, []).append(float(a.logprobs[0, 0]))
        sched.update_from_output(so, out)
    return tokens, lps, replays


def load_tiny(path: str, device: str = "cpu") -> tuple[torch.nn.Module, int]:
    from tidal.worker.hf_config import load_hf_config
    from tidal.worker.loader import load_model

    cfg = load_hf_config(path)
    return load_model(path, cfg, torch.float32, device=device), cfg.vocab_size


def test_padded_replay_samples_what_eager_samples(tiny_model_dir: str) -> None:
    model, vocab = load_tiny(tiny_model_dir)
    t_eager, lp_eager, _ = run_requests(model, vocab, False)
    t_graph, lp_graph, replays = run_requests(model, vocab, True)
    assert replays and any(n < p for n, p in replays)  # padded replays happened
    assert capture_sizes(7) == [1, 2, 4, 7] and all(p == padded_size(n, [1, 2, 4, 7]) for n, p in replays)
    assert t_graph == t_eager
    for rid in lp_eager:
        np.testing.assert_allclose(lp_graph[rid], lp_eager[rid], rtol=0, atol=1e-4)


def test_triton_replay_under_capture_metadata(tiny_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton backend (interpreter) over padded buffers under the exact metadata a graph
    is captured with (max_seq_len = max_model_len, so split-KV partitions run past every
    sequence's end; padding slots -1) samples what eager Triton steps sample."""
    pytest.importorskip("triton")
    from tidal.worker import attention_triton
    from tidal.worker.attention_triton import InterpretedFunction

    if not isinstance(attention_triton._attention_kernel, InterpretedFunction):
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this session")
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", "triton")
    assert backend_is_graph_safe(torch.device("cpu"))[0]
    kw = dict(num_reqs=3, max_num_seqs=4, max_model_len=1024, max_tokens=(3, 5))
    model, vocab = load_tiny(tiny_model_dir)
    t_eager, lp_eager, _ = run_requests(model, vocab, False, **kw)
    model, vocab = load_tiny(tiny_model_dir)  # fresh layers (each binds its backend at first use)
    t_graph, lp_graph, replays = run_requests(model, vocab, True, as_captured=True, sizes=[4], **kw)
    assert replays and all(p == 4 for _, p in replays) and any(n < 4 for n, _ in replays)
    assert t_graph == t_eager
    for rid in lp_eager:
        np.testing.assert_allclose(lp_graph[rid], lp_eager[rid], rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graph_replay_matches_eager_on_gpu(tiny_model_dir: str) -> None:
    """On a GPU: graphs captured over the persistent buffers (Triton backend) replay decode
    steps, padded ones included, and sample what eager steps sample."""
    kw = dict(num_reqs=7, max_num_seqs=8, max_model_len=2048, max_tokens=(8, 40))
    model, vocab = load_tiny(tiny_model_dir, "cuda")
    t_eager, lp_eager, _ = run_requests(model, vocab, False, **kw)
    model, vocab = load_tiny(tiny_model_dir, "cuda")
    t_graph, lp_graph, replays = run_requests(model, vocab, True, sizes=[1, 2, 4, 8], **kw)
    assert replays and any(n < p for n, p in replays)
    assert t_graph == t_eager
    for rid in lp_eager:
        np.testing.assert_allclose(lp_graph[rid], lp_eager[rid], rtol=0, atol=1e-3)
