"""Short multi-row sequences (a speculative verification's 1 + k rows) through the CPU backend's
paged decode kernel, one kernel row per query row (AttentionMetadata.short_seqs / paged_rows),
against a float64 reference written from the definition and against the torch path.

Row j of a sequence with q query rows at seq_len attends positions (p - window, p], p =
seq_len - q + j: a decode of context seq_len - q + 1 + j over the same block table, because the
step writes its K/V into the cache before attention reads.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from tidal.protocol.sizing import cdiv
from tidal.worker import cpu_kernels as ck
from tidal.worker.attention_cpu import CpuAttentionBackend, PagedDecodeBatch
from tidal.worker.attention_metadata import PAGED_ROWS_MAX_QUERY_LEN, AttentionMetadata
from tidal.worker.attention_torch import TorchAttentionBackend

pytestmark = pytest.mark.skipif(ck.cpu_kernels() is None, reason="no C compiler: kernels unavailable")

BS = 4  # small blocks: every verify row set crosses block boundaries somewhere
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64
ATOL = 2e-5

# (query_len, seq_len): decodes, verifications q = 2..9 over contexts of several lengths (block
# multiples, one past, ending mid-block), prefill chunks on cached context (short and long),
# fresh prompts (short: the prefill path; long), chunks of 16 and 17 rows (past the bound).
MIXED = [
    (1, 1), (3, 7), (1, 9), (2, 2 + 4), (9, 9 + 3), (17, 17 + 5), (5, 5 + 16), (1, 40),
    (4, 4 + 1), (30, 30), (6, 6 + 23), (3, 3), (7, 7 + 8), (8, 8 + 37), (16, 16 + 2), (1, 4),
    (2, 2 + 1), (40, 40 + 9), (9, 9 + 60), (10, 10 + 6),
]


def _case(seqs: list[tuple[int, int]], dtype: torch.dtype, seed: int) -> dict:
    """A shuffled block pool holding every sequence's context (in `dtype`), the step's q/k/v."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    need = [cdiv(n, BS) for _, n in seqs]
    num_blocks = sum(need) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.zeros(len(seqs), max(need) + 2, dtype=torch.long)  # padded columns too
    for i, n in enumerate(need):
        tables[i, :n] = torch.tensor(ids[:n])
        ids = ids[n:]
    shape = (num_blocks, BS, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    total = sum(q for q, _ in seqs)
    q = torch.randn(total, HEADS, HEAD_DIM, generator=gen)
    k = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen)
    qsl, slots = [0], []
    for i, (ql, n) in enumerate(seqs):
        qsl.append(qsl[-1] + ql)
        slots += [int(tables[i, p // BS]) * BS + p % BS for p in range(n - ql, n)]
    return dict(q=q, k=k, v=v, k_cache=k_cache, v_cache=v_cache, tables=tables, qsl=qsl,
                slots=torch.tensor(slots), seqs=seqs)


def _reference(case: dict, scale: float, window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """float64: each query at position p over its sequence's keys j with p - window < j <= p.
    A sequence that reads its context from the cache sees the new K/V as the cache stores them
    (rounded in a half cache); a fresh multi-row prompt attends them as computed."""
    q, dtype = case["q"].double(), case["k_cache"].dtype
    flat_k = case["k_cache"].view(-1, KV_HEADS, HEAD_DIM).double().clone()
    flat_v = case["v_cache"].view(-1, KV_HEADS, HEAD_DIM).double().clone()
    flat_k[case["slots"]] = case["k"].to(dtype).double()
    flat_v[case["slots"]] = case["v"].to(dtype).double()
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    for i, (ql, n) in enumerate(case["seqs"]):
        s, e = case["qsl"][i], case["qsl"][i + 1]
        slots = [int(case["tables"][i, p // BS]) * BS + p % BS for p in range(n)]
        ctx_k, ctx_v = flat_k[slots], flat_v[slots]
        if ql > 1 and ql == n:  # fresh prompt: its own K/V as computed
            ctx_k, ctx_v = case["k"][s:e].double(), case["v"][s:e].double()
        # freed blocks (NaN) lie outside every window: never weighted, zero them for the matmul
        ctx_k, ctx_v = ctx_k.nan_to_num(0.0), ctx_v.nan_to_num(0.0)
        q_pos = torch.arange(n - ql, n)[:, None]
        k_pos = torch.arange(n)[None, :]
        visible = k_pos <= q_pos
        if window is not None:
            visible &= k_pos > q_pos - window
        for h in range(HEADS):
            scores = q[s:e, h] @ ctx_k[:, h // group].T * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~visible, -math.inf)
            if sinks is not None:
                scores = torch.cat([scores, torch.full((ql, 1), float(sinks[h]), dtype=torch.float64)], -1)
            probs = torch.softmax(scores, -1)[:, :n]
            out[s:e, h] = probs @ ctx_v[:, h // group]
    return out


def _meta(case: dict) -> AttentionMetadata:
    return AttentionMetadata.build(case["slots"], case["qsl"], [n for _, n in case["seqs"]], case["tables"], BS)


def _run(backend: TorchAttentionBackend, case: dict, scale: float, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    kc, vc = case["k_cache"].clone(), case["v_cache"].clone()
    out = backend.forward(case["q"], case["k"], case["v"], kc, vc, _meta(case), scale, **kw)
    return out, kc


def _free_before_windows(case: dict, window: int) -> None:
    """NaN every block wholly before the window of a sequence's first query row, as after the
    blocks were freed and reused: no backend may read them."""
    for i, (ql, n) in enumerate(case["seqs"]):
        first = max(0, n - ql + 1 - window)  # first position the first row sees
        for b in range(first // BS):
            block = int(case["tables"][i, b])
            case["k_cache"][block] = float("nan")
            case["v_cache"][block] = float("nan")


def _expected_short(seqs: list[tuple[int, int]]) -> list[int]:
    return [i for i, (ql, n) in enumerate(seqs) if 1 < ql <= PAGED_ROWS_MAX_QUERY_LEN and n > ql]


def test_metadata_views() -> None:
    case = _case(MIXED, torch.float32, seed=0)
    meta = _meta(case)
    short = _expected_short(MIXED)
    assert meta.decode_seqs == [i for i, (ql, _) in enumerate(MIXED) if ql == 1]  # unchanged meaning
    assert meta.short_seqs == short and PAGED_ROWS_MAX_QUERY_LEN in [MIXED[i][0] for i in short]
    assert any(ql == PAGED_ROWS_MAX_QUERY_LEN + 1 and n > ql for ql, n in MIXED)  # just past it
    every = [s.q_start for s in meta.prefill_spans(None)]
    assert every == [case["qsl"][i] for i, (ql, _) in enumerate(MIXED) if ql > 1]  # the default
    left = [s.q_start for s in meta.prefill_spans(None, paged_rows=True)]
    assert left == [case["qsl"][i] for i, (ql, _) in enumerate(MIXED) if ql > 1 and i not in short]
    batch = meta.paged_rows
    rows, lens, tables = [], [], []
    for i in meta.decode_seqs:
        rows.append(case["qsl"][i])
        lens.append(MIXED[i][1])
        tables.append(i)
    for i in short:
        ql, n = MIXED[i]
        rows += range(case["qsl"][i], case["qsl"][i + 1])
        lens += range(n - ql + 1, n + 1)
        tables += [i] * ql
    assert batch.rows.tolist() == rows and batch.seq_lens.tolist() == lens
    assert torch.equal(batch.block_tables, case["tables"][tables])
    assert batch.rows.dtype == batch.seq_lens.dtype == batch.block_tables.dtype == torch.int64
    assert batch.block_tables.is_contiguous()
    # decodes only: paged_rows is paged_decode (a CPU-graph metadata sets that one)
    dec = _case([(1, 5), (1, 9)], torch.float32, seed=1)
    meta = _meta(dec)
    assert meta.short_seqs == [] and meta.paged_rows is meta.paged_decode
    assert isinstance(meta.paged_decode, PagedDecodeBatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3, 7, 16])
def test_mixed_batch_matches_reference(dtype: torch.dtype, window: int | None) -> None:
    case = _case(MIXED, dtype, seed=(window or 0) + 1)
    if window is not None:
        _free_before_windows(case, window)
    scale = HEAD_DIM**-0.5
    want = _reference(case, scale, window)
    calls = []
    backend = CpuAttentionBackend()
    prefill = backend._prefill
    backend._prefill = lambda q, k, v, fk, fv, span, *a: (calls.append(span.q_start), prefill(q, k, v, fk, fv, span, *a))
    got, kc = _run(backend, case, scale, sliding_window=window)
    short = _expected_short(MIXED)
    assert calls == [case["qsl"][i] for i, (ql, _) in enumerate(MIXED) if ql > 1 and i not in short]
    assert not got.isnan().any()
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    ref, ref_kc = _run(TorchAttentionBackend(), case, scale, sliding_window=window)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
    assert torch.equal(kc.view(torch.uint8), ref_kc.view(torch.uint8))  # NaNs included


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("variant", ["softcap", "sinks", "both"])
def test_softcap_and_sinks(variant: str, window: int | None) -> None:
    case = _case(MIXED, torch.float32, seed=7)
    if window is not None:
        _free_before_windows(case, window)
    scale = HEAD_DIM**-0.5
    softcap = 0.5 if variant != "sinks" else None  # low: the cap binds on most scores
    sinks = torch.tensor([2.0, -1.0, 0.5, -math.inf]) if variant != "softcap" else None
    want = _reference(case, scale, window, softcap, sinks)
    got, _ = _run(CpuAttentionBackend(), case, scale, sliding_window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=0)
    ref, _ = _run(TorchAttentionBackend(), case, scale, sliding_window=window, softcap=softcap, sinks=sinks)
    torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 3, 33])
def test_verify_only_batch(k: int, batch: int) -> None:
    """Every sequence verifies k proposals (no decodes, no prefills): one kernel call."""
    rng = random.Random(k * 100 + batch)
    seqs = [(1 + k, 1 + k + rng.randint(1, 50)) for _ in range(batch)]
    case = _case(seqs, torch.float32, seed=k + batch)
    scale = HEAD_DIM**-0.5
    backend = CpuAttentionBackend()
    backend._prefill = None  # never called
    got, _ = _run(backend, case, scale)
    torch.testing.assert_close(got.double(), _reference(case, scale), atol=ATOL, rtol=0)


def test_unsupported_inputs_take_the_torch_path() -> None:
    """A float64 step (no kernel for it) attends its short sequences as prefill chunks."""
    seqs = [(1, 6), (4, 4 + 5), (9, 9 + 14)]
    case = _case(seqs, torch.float64, seed=3)
    for name in ("q", "k", "v"):
        case[name] = case[name].double()
    scale = HEAD_DIM**-0.5
    calls = []
    backend = CpuAttentionBackend()
    prefill = backend._prefill
    backend._prefill = lambda *a: (calls.append(a[5].q_start), prefill(*a))
    got, _ = _run(backend, case, scale, sliding_window=6)
    assert calls == [1, 5]
    torch.testing.assert_close(got, _reference(case, scale, 6), atol=1e-10, rtol=0)


def test_bad_block_table_in_a_verify_row_is_refused() -> None:
    case = _case([(1, 6), (5, 5 + 8)], torch.float32, seed=4)
    case["tables"][1, 2] = case["k_cache"].shape[0] + 3  # the last block of the verify rows
    with pytest.raises(RuntimeError, match="out of range"):
        _run(CpuAttentionBackend(), case, 0.125)
