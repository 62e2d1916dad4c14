"""The Triton attention backend against the torch reference: under the Triton interpreter on
CPU (CI), or compiled on a CUDA device when one is present (scripts/device_check.sh).

TRITON_INTERPRET must be set before triton decorates the kernels (when attention_triton is
imported), so it is set first thing when there is no GPU (or TIDAL_TRITON_TESTS_INTERPRET=1);
it stays set for the session (triton imports parts of itself lazily and checks it again). On
a GPU the batches are built on the CPU, run on the device, and compared back on the CPU.
"""

from __future__ import annotations

import copy
import os

import torch

ON_GPU = torch.cuda.is_available() and os.environ.get("TIDAL_TRITON_TESTS_INTERPRET") != "1"
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
DEV = torch.device("cuda" if ON_GPU else "cpu")

import logging  # noqa: E402
import random  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Any  # noqa: E402

import pytest  # noqa: E402

cpu_only = pytest.mark.skipif(ON_GPU, reason="runs on CPU tensors under the interpreter")
pytest.importorskip("triton")

from tidal.worker import attention_triton  # noqa: E402
from tidal.worker.attention import Attention  # noqa: E402
from tidal.worker.attention_metadata import AttentionMetadata  # noqa: E402
from tidal.worker.attention_torch import TorchAttentionBackend  # noqa: E402
from tidal.worker.attention_triton import TritonAttentionBackend, _num_splits  # noqa: E402
from tidal.worker.forward_context import set_forward_context  # noqa: E402

# Per q dtype: max |triton - float64 reference| (q, k, v ~ N(0, 1)).
ATOL = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


@dataclass
class Batch:
    """One step: q/k/v for the new tokens, caches holding earlier context (random values at
    positions before each chunk), and what AttentionMetadata.build needs."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    slots: list[int]
    qsl: list[int]
    seq_lens: list[int]
    tables: torch.Tensor
    block_size: int

    def meta(self) -> AttentionMetadata:
        return AttentionMetadata.build(torch.tensor(self.slots, dtype=torch.long), self.qsl, self.seq_lens,
                                       self.tables.clone(), self.block_size)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_cache.clone(), self.v_cache.clone()


def make_batch(seqs: list[tuple[int, int]], heads: int = 2, kv_heads: int = 1, head_dim: int = 64,
               block_size: int = 16, dtype: torch.dtype = torch.float32, cache_dtype: torch.dtype | None = None,
               pad_tokens: int = 0, seed: int = 0, preround: bool = True) -> Batch:
    """seqs: (query_len, seq_len) per sequence, in batch order. Block ids come shuffled from a
    pool with spare blocks, tables have an extra column of padding (0s)."""
    g = torch.Generator().manual_seed(seed)
    needed = [-(-seq_len // block_size) for _, seq_len in seqs]
    num_blocks = sum(needed) + 3
    pool = torch.randperm(num_blocks, generator=g).tolist()
    tables = torch.zeros(len(seqs), max(needed) + 1, dtype=torch.long)
    qsl, slots = [0], []
    for row, ((q_len, seq_len), n) in enumerate(zip(seqs, needed)):
        tables[row, :n] = torch.tensor([pool.pop() for _ in range(n)])
        qsl.append(qsl[-1] + q_len)
        slots += [int(tables[row, p // block_size]) * block_size + p % block_size
                  for p in range(seq_len - q_len, seq_len)]
    slots += [-1] * pad_tokens  # tokens outside every sequence (a padded batch)
    tokens = qsl[-1] + pad_tokens
    cache_dtype = cache_dtype or dtype
    # Values pre-rounded to the cache dtype: the reference attends to a plain prefill's new K/V
    # as given, Triton reads them back from the cache, and the two must then agree exactly.
    k, v = (torch.randn(tokens, kv_heads, head_dim, generator=g) for _ in range(2))
    if preround:
        k, v = k.to(cache_dtype), v.to(cache_dtype)
    k, v = k.to(dtype), v.to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=g).to(cache_dtype) for _ in range(2))
    q = torch.randn(tokens, heads, head_dim, generator=g).to(dtype)
    return Batch(q, k, v, k_cache, v_cache, slots, qsl, [s for _, s in seqs], tables, block_size)


def on_device(meta: AttentionMetadata) -> AttentionMetadata:
    """meta with its tensors on DEV (itself on the CPU); host fields and flags as they are."""
    if DEV.type == "cpu":
        return meta
    m = copy.copy(meta)
    m.slot_mapping, m.block_tables = meta.slot_mapping.to(DEV), meta.block_tables.to(DEV)
    if meta.query_start_loc_device is not None:
        m.query_start_loc_device = meta.query_start_loc_device.to(DEV)
    if meta.seq_lens_device is not None:
        m.seq_lens_device = meta.seq_lens_device.to(DEV)
    return m


def forward(backend: TritonAttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """backend.forward on DEV; the CPU caches kc/vc get what it wrote, the output comes back
    on the CPU. The check flag the backend sets is copied back to `meta`."""
    if DEV.type == "cpu":
        return backend.forward(q, k, v, kc, vc, meta, scale)
    m = on_device(meta)
    kd, vd = kc.to(DEV), vc.to(DEV)
    try:
        out = backend.forward(q.to(DEV), k.to(DEV), v.to(DEV), kd, vd, m, scale)
    finally:
        kc.copy_(kd.cpu())
        vc.copy_(vd.cpu())
        meta.block_tables_checked = m.block_tables_checked
    return out.cpu()


def run_triton(b: Batch, meta: AttentionMetadata | None = None,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    kc, vc = b.caches()
    out = forward(TritonAttentionBackend(**kwargs), b.q, b.k, b.v, kc, vc, meta or b.meta(), b.q.shape[2] ** -0.5)
    return out, kc, vc


def run_reference(b: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(float64 output, output in b's dtype, caches the reference wrote in b's cache dtype)."""
    scale = b.q.shape[2] ** -0.5
    kc, vc = b.caches()
    same = TorchAttentionBackend().forward(b.q, b.k, b.v, kc, vc, b.meta(), scale)
    wide = TorchAttentionBackend().forward(b.q.double(), b.k.double(), b.v.double(), b.k_cache.double(),
                                           b.v_cache.double(), b.meta(), scale)
    return wide, same, kc, vc


def check(b: Batch, atol: float | None = None, **kwargs: Any) -> torch.Tensor:
    """Triton vs the float64 reference on every token in a sequence; caches byte-equal to the
    reference's. Returns Triton's output."""
    out, kc, vc = run_triton(b, **kwargs)
    wide, same, ref_kc, ref_vc = run_reference(b)
    n = b.qsl[-1]
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    torch.testing.assert_close(out[:n].double(), wide[:n], atol=atol or ATOL[b.q.dtype], rtol=0)
    # No worse than the reference in the same dtype. Not for bf16 output: the interpreter
    # converts float32 to bf16 by truncation (compiled Triton rounds to nearest even).
    ours, theirs = (out[:n].double() - wide[:n]).abs().max(), (same[:n].double() - wide[:n]).abs().max()
    assert out.dtype == torch.bfloat16 or ours <= 1.5 * theirs + 2 * ATOL[torch.float32], (ours, theirs)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    return out


# decode | plain prefill | chunk over a cached prefix (boundary inside a block) | decode |
# chunk starting exactly on a block boundary | chunk longer than a block over a prefix
MIXED = [(1, 9), (5, 5), (4, 20), (1, 33), (3, 19), (18, 27)]


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_mixed_batch_gqa_block_sizes(block_size: int, group: int) -> None:
    kv_heads = 2 if group <= 2 else 1
    check(make_batch(MIXED, heads=kv_heads * group, kv_heads=kv_heads, block_size=block_size, seed=group))


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim: int) -> None:
    check(make_batch([(3, 7), (1, 18), (4, 4)], head_dim=head_dim, seed=head_dim))


@pytest.mark.parametrize("dtype,cache_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
    (torch.float32, torch.float16), (torch.float32, torch.bfloat16),  # half cache under fp32 compute
])
def test_dtypes(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    check(make_batch([(1, 21), (6, 6), (3, 40)], heads=4, kv_heads=2, dtype=dtype, cache_dtype=cache_dtype))


def test_write_converts_to_the_cache_dtype() -> None:
    """float32 K/V written into a float16 cache round exactly as the reference's .to() does
    (only contexts read back from the cache here: no plain prefill, which the reference
    attends unrounded). bf16 is left out: the interpreter truncates float32 to bf16."""
    b = make_batch([(1, 21), (3, 40), (1, 2)], heads=2, kv_heads=2, cache_dtype=torch.float16, preround=False)
    out, kc, vc = run_triton(b)
    _, same, ref_kc, ref_vc = run_reference(b)  # (the float64 one writes unrounded K/V)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)
    torch.testing.assert_close(out, same, atol=ATOL[torch.float32], rtol=0)


def test_odd_group_and_small_head_dim() -> None:
    """3 query heads per kv head (rows past BLOCK_Q * 3 are masked), head_dim 16, block size 4."""
    check(make_batch([(7, 7), (1, 13), (5, 11)], heads=6, kv_heads=2, head_dim=16, block_size=4))


def test_chunked_prefill_over_steps_matches_whole_sequence() -> None:
    """One sequence written and attended in chunks of 5, 13, 1 and 7 tokens (boundaries inside
    16-token blocks) equals causal attention over the whole sequence at once."""
    torch.manual_seed(0)
    seq_len, heads, kv_heads, head_dim, bs = 26, 4, 2, 64, 16
    q = torch.randn(seq_len, heads, head_dim)
    k, v = torch.randn(seq_len, kv_heads, head_dim), torch.randn(seq_len, kv_heads, head_dim)
    table = torch.tensor([[3, 0, 2]])
    kc, vc = torch.zeros(4, bs, kv_heads, head_dim), torch.zeros(4, bs, kv_heads, head_dim)
    backend, outs, start = TritonAttentionBackend(), [], 0
    for n in (5, 13, 1, 7):
        pos = range(start, start + n)
        slots = torch.tensor([int(table[0, p // bs]) * bs + p % bs for p in pos])
        meta = AttentionMetadata.build(slots, [0, n], [start + n], table, bs)
        outs.append(forward(backend, q[start:start + n], k[start:start + n], v[start:start + n], kc, vc, meta,
                            head_dim ** -0.5))
        start += n
    whole = make_batch([(seq_len, seq_len)], heads, kv_heads, head_dim, bs)
    whole.q, whole.k, whole.v = q, k, v
    wide = run_reference(whole)[0]
    torch.testing.assert_close(torch.cat(outs).double(), wide, atol=ATOL[torch.float32], rtol=0)


def test_padding_slots_not_written() -> None:
    """A CUDA-graph style padded batch: padding tokens outside every sequence and a padding
    decode sequence (slot -1, seq_len 1, a valid block row) write nothing."""
    b = make_batch([(1, 12), (2, 9), (1, 1)], heads=2, kv_heads=1, pad_tokens=3, seed=5)
    b.slots[b.qsl[2]] = -1  # the third sequence is padding
    out, kc, vc = run_triton(b)
    expect_k, expect_v = b.caches()
    real = [(t, s) for t, s in enumerate(b.slots) if s >= 0]
    flat_k, flat_v = expect_k.view(-1, 1, 64), expect_v.view(-1, 1, 64)
    for t, s in real:
        flat_k[s], flat_v[s] = b.k[t], b.v[t]
    assert torch.equal(kc, expect_k) and torch.equal(vc, expect_v)
    wide = run_reference(b)[0]
    torch.testing.assert_close(out[:b.qsl[2]].double(), wide[:b.qsl[2]], atol=ATOL[torch.float32], rtol=0)


def test_split_kv_matches_single_pass() -> None:
    b = make_batch([(1, 150), (1, 70), (1, 1), (1, 129)], heads=4, kv_heads=2, seed=7)
    single = check(b, force_num_splits=1)
    for splits in (3, 8):  # 8: most partitions of the short sequences are empty
        split = check(b, force_num_splits=splits)
        torch.testing.assert_close(split, single, atol=1e-6, rtol=0)
    # Forced on a mixed batch too: the kernel family serves prefill rows the same way.
    check(make_batch(MIXED[:4], heads=2, kv_heads=1), force_num_splits=3)


def test_split_kv_chosen_from_host_ints() -> None:
    """Auto: a long decode batch on few programs splits (and matches the reference); prefills,
    short contexts and wide batches do not."""
    b = make_batch([(1, 2100)], heads=2, kv_heads=1, block_size=32, seed=9)
    meta, dev = b.meta(), torch.device("cpu")
    assert _num_splits(meta, 1, dev) == 8  # 132 SMs (on CPU), >= 256 positions per partition
    check(b)
    assert _num_splits(make_batch([(2, 2100)]).meta(), 1, dev) == 1
    assert _num_splits(make_batch([(1, 500)]).meta(), 1, dev) == 1
    wide = AttentionMetadata.build(torch.zeros(200, dtype=torch.long), list(range(201)), [4096] * 200,
                                   torch.zeros(200, 1, dtype=torch.long), 4096)
    assert _num_splits(wide, 1, dev) == 1


def test_graph_style_decode_needs_only_device_tensors_and_host_ints(monkeypatch: pytest.MonkeyPatch) -> None:
    """As a CUDA-graph replay runs it: max_seq_len a fixed upper bound (it picks the split
    count), padding rows, block tables checked by the builder. No host sync (.item, .tolist,
    bool(tensor), nonzero) and none of the per-sequence host views may be touched."""
    b = make_batch([(1, 12), (1, 40), (1, 1)], heads=2, kv_heads=1, seed=11)
    b.slots[2] = -1  # padding row: seq_len 1, a valid block row
    meta = b.meta()
    meta.max_seq_len, meta.block_tables_checked = 1024, True
    meta.device_query_start_loc(), meta.device_seq_lens()  # the builder's persistent buffers
    meta.decode_seqs = None  # type: ignore[assignment]

    def forbidden(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("host sync or host-side per-sequence view in the decode path")

    for name in ("item", "tolist", "__bool__", "nonzero"):
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    for name in ("prefills", "decode_groups", "write_token_indices", "paged_decode"):
        monkeypatch.setattr(AttentionMetadata, name, property(forbidden), raising=False)
    assert _num_splits(meta, 1, torch.device("cpu")) == 4
    out, kc, vc = run_triton(b, meta)
    monkeypatch.undo()
    wide, _, ref_kc, ref_vc = run_reference(b)
    torch.testing.assert_close(out[:2].double(), wide[:2], atol=ATOL[torch.float32], rtol=0)
    assert torch.equal(kc, ref_kc) and torch.equal(vc, ref_vc)


@pytest.mark.parametrize("what", ["too_big", "negative", "slot"])
def test_bad_block_ids_refused_before_any_write(what: str) -> None:
    b = make_batch([(1, 12), (3, 40), (1, 5)], seed=3)
    num_blocks = b.k_cache.shape[0]
    if what == "too_big":
        b.tables[1, 2] = num_blocks + 5
        bad = num_blocks + 5
    elif what == "negative":
        b.tables[1, 0] = bad = -2
    else:
        b.slots[1] = bad = num_blocks * 16 + 3  # a write past the cache, sequence 1's first token
        bad //= 16
    meta = b.meta()
    kc, vc = b.caches()
    with pytest.raises(ValueError, match=rf"sequence 1\b.*{bad}.*{num_blocks}"):
        forward(TritonAttentionBackend(), b.q, b.k, b.v, kc, vc, meta, 0.125)
    assert torch.equal(kc, b.k_cache) and torch.equal(vc, b.v_cache)
    assert not meta.block_tables_checked


def test_check_reads_only_owned_entries_and_sets_flag() -> None:
    """Entries past a sequence's own blocks (padding) may be anything; a passing check sets the
    flag so later layers skip it."""
    b = make_batch([(1, 12), (3, 20)], seed=4)
    b.tables[0, 1:] = 10**6
    meta = b.meta()
    kc, vc = b.caches()
    forward(TritonAttentionBackend(), b.q, b.k, b.v, kc, vc, meta, 0.125)
    assert meta.block_tables_checked


@cpu_only
def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the interpreter CPU tensors are refused clearly; tidal.worker.attention imports
    without triton."""
    monkeypatch.setattr(attention_triton, "InterpretedFunction", type("NotInterpreted", (), {}))
    b = make_batch([(2, 2)])
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        TritonAttentionBackend().forward(b.q, b.k, b.v, *b.caches(), b.meta(), 0.125)
    code = "import sys; sys.modules['triton'] = None; import tidal.worker.attention"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---- end to end: a tiny model through the Triton backend vs transformers ----

def _paged_step(model: torch.nn.Module, tokens: list[int], start: int, table: list[int], bs: int) -> torch.Tensor:
    """Run `tokens` (positions start..) of one sequence whose blocks are `table`; last logits."""
    pos = list(range(start, start + len(tokens)))
    slots = torch.tensor([table[p // bs] * bs + p % bs for p in pos])
    meta = AttentionMetadata.build(slots, [0, len(tokens)], [pos[-1] + 1], torch.tensor([table]), bs)
    with torch.no_grad(), set_forward_context(meta):
        hidden = model(torch.tensor(tokens), torch.tensor(pos))
        return model.compute_logits(hidden)[-1]


@cpu_only  # on a GPU: tests/test_gpu.py runs whole models through the engine
def test_tiny_model_greedy_matches_transformers(tmp_path: Any, tidal_cache_dir: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tidal.frontend.entrypoints.make_model import make_model
    from tidal.worker.loader import load_model

    logging.getLogger("transformers").setLevel(logging.ERROR)
    monkeypatch.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
    monkeypatch.setenv("TIDAL_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("TIDAL_CPU_GEMM", "torch")  # F.linear: no C GEMM kernels to build (seconds)
    path = make_model(str(tmp_path / "m"), "qwen3", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=64, seed=3)
    model = load_model(path, AutoConfig.from_pretrained(path), torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    bs, num_blocks = 8, 6
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for layer in layers:
        shape = (num_blocks, bs, layer.num_kv_heads, layer.head_dim)
        layer.k_cache, layer.v_cache = torch.zeros(shape), torch.zeros(shape)
    table = random.Random(0).sample(range(num_blocks), 3)
    prompt = torch.randint(3, 512, (11,), generator=torch.Generator().manual_seed(1)).tolist()
    tokens = list(prompt)
    logits = _paged_step(model, prompt[:6], 0, table, bs)  # prompt in two chunks: the second
    logits = _paged_step(model, prompt[6:], 6, table, bs)  # reads the first from the cache
    for _ in range(8):
        tokens.append(int(logits.argmax()))
        logits = _paged_step(model, tokens[-1:], len(tokens) - 1, table, bs)
    assert all(isinstance(layer.backend, TritonAttentionBackend) for layer in layers)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    assert tokens == ref[0].tolist()
