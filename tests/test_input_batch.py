"""Persistent model-runner inputs (worker/input_batch.py): after every step the runner's step
tensors (tokens, positions, slots, block table rows, seq_lens, query_start_loc, LM-head rows)
equal what a straightforward reference builds from the request states, across adds, chunked
prefills, block growth, finishes, aborts, preemptions and resumptions; both the CPU path (the
buffers are the staging memory) and the CUDA path's logic (separate staging, rows uploaded
into a device table and gathered with index_select), run here on CPU tensors. A tiny model then
samples exactly the same tokens (and logprobs) through the persistent path as through the
runner's former per-step tensors."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler import Scheduler
from tidal.protocol import SamplingParams
from tidal.protocol.messages import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tidal.worker.attention_metadata import AttentionMetadata
from tidal.worker.input_batch import PAD_ROW, InputBatch
from tidal.worker.model_runner import ModelRunner, _Batch

BS = 4


# ------------------------------------------------------------------ reference


@dataclass
class RefReq:
    tokens: list[int]
    blocks: list[int]
    computed: int
    num_prompt: int
    prompt_logprobs: bool = False


@dataclass
class RefStep:
    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    qsl: list[int] = field(default_factory=lambda: [0])
    seq_lens: list[int] = field(default_factory=list)
    block_table: np.ndarray | None = None  # [B, widest] zero-padded
    logits_rows: list[int] = field(default_factory=list)


class Shadow:
    """Request state kept from the SchedulerOutputs alone, and the step inputs built the
    plain way (per request, per token)."""

    def __init__(self) -> None:
        self.reqs: dict[str, RefReq] = {}

    def update(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.reqs.pop(rid, None)
        for n in so.scheduled_new_reqs:
            self.reqs[n.req_id] = RefReq(list(n.prompt_token_ids) + list(n.output_token_ids), list(n.block_ids),
                                         n.num_computed_tokens, len(n.prompt_token_ids),
                                         n.sampling_params.prompt_logprobs is not None)
        for c in so.scheduled_cached_reqs:
            r = self.reqs[c.req_id]
            r.tokens += c.new_token_ids
            r.blocks += c.new_block_ids
            r.computed = c.num_computed_tokens

    def step(self, so: SchedulerOutput) -> RefStep:
        ref = RefStep()
        reqs = [self.reqs[rid] for rid in so.num_scheduled_tokens]
        width = max(len(r.blocks) for r in reqs)
        ref.block_table = np.zeros((len(reqs), width), dtype=np.int64)
        sample, lp = [], []
        for i, (rid, n) in enumerate(so.num_scheduled_tokens.items()):
            r = self.reqs[rid]
            ref.block_table[i, : len(r.blocks)] = r.blocks
            for p in range(r.computed, r.computed + n):
                ref.tokens.append(r.tokens[p])
                ref.positions.append(p)
                ref.slots.append(r.blocks[p // BS] * BS + p % BS)
            ref.qsl.append(ref.qsl[-1] + n)
            ref.seq_lens.append(r.computed + n)
            if r.computed + n >= len(r.tokens):
                sample.append(ref.qsl[-1] - 1)
            if r.prompt_logprobs and r.computed < r.num_prompt - 1:
                rows = min(r.computed + n, r.num_prompt - 1) - r.computed
                lp += range(ref.qsl[i], ref.qsl[i] + rows)
        ref.logits_rows = sample + lp
        return ref


def check_step(batch: _Batch, ref: RefStep, runner: ModelRunner) -> None:
    meta = batch.metadata
    assert meta is not None and meta.block_tables_checked
    assert batch.input_ids.tolist() == ref.tokens
    assert batch.positions.tolist() == ref.positions
    assert meta.slot_mapping.tolist() == ref.slots
    assert meta.query_start_loc == ref.qsl and meta.seq_lens == ref.seq_lens
    assert meta.device_query_start_loc().dtype == torch.int32
    assert meta.device_query_start_loc().tolist() == ref.qsl
    assert meta.device_seq_lens().dtype == torch.int32 and meta.device_seq_lens().tolist() == ref.seq_lens
    table = meta.block_tables
    assert table.dtype == torch.int64 and table.shape[0] == len(ref.seq_lens)
    width = ref.block_table.shape[1]
    assert table.shape[1] >= width
    np.testing.assert_array_equal(table[:, :width].numpy(), ref.block_table)
    # Past a row's own blocks: zeros (CPU: no such columns beyond the widest row).
    assert not table[:, width:].any()
    rows = batch.logits_index.tolist() if batch.logits_index is not None else list(range(len(ref.tokens)))
    assert rows == ref.logits_rows
    # The step's tensors are views of the persistent buffers.
    ib = runner.input_batch
    assert batch.input_ids.data_ptr() == ib.input_ids.dev.data_ptr()
    assert meta.slot_mapping.data_ptr() == ib.slot_mapping.dev.data_ptr()
    assert meta.device_seq_lens().data_ptr() == ib.seq_lens.dev.data_ptr()


def make_runner(separate: bool, max_num_seqs: int = 8, max_tokens: int = 32, max_model_len: int = 64,
                num_blocks: int = 64, model: torch.nn.Module | None = None) -> ModelRunner:
    runner = ModelRunner(model or torch.nn.Identity(), block_size=BS, vocab_size=50, device=torch.device("cpu"),
                         max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens, max_model_len=max_model_len)
    if separate:  # the CUDA path's logic on CPU tensors
        runner.input_batch = InputBatch(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                                        max_model_len=max_model_len, block_size=BS,
                                        device=torch.device("cpu"), separate_staging=True)
    runner.input_batch.num_blocks = num_blocks
    return runner


def check_rows(runner: ModelRunner) -> None:
    ib = runner.input_batch
    rows = [st.row for st in runner.requests.values()]
    assert sorted(ib.row_of.values()) == sorted(rows) and len(set(rows)) == len(rows)
    assert PAD_ROW not in rows and not ib.table[PAD_ROW].any()
    for rid, st in runner.requests.items():
        assert ib.row_of[rid] == st.row
        n = len(st.block_ids)
        assert ib.row_blocks[st.row] == n
        assert ib.table[st.row, :n].tolist() == st.block_ids and not ib.table[st.row, n:].any()
        if ib.separate:  # the device table holds what the host table holds (after the step's upload)
            assert ib.table_dev[st.row].tolist() == ib.table[st.row].tolist()
    assert ib._num_rows <= max(len(rows), 1) + 16  # rows are reused, not leaked


# ------------------------------------------------------------------ hand-written steps


def new(rid: str, prompt: list[int], blocks: list[int], computed: int = 0, out: list[int] | None = None,
        prompt_logprobs: int | None = None) -> NewRequestData:
    return NewRequestData(rid, prompt, SamplingParams(prompt_logprobs=prompt_logprobs), blocks, computed,
                          out or [])


def cached(rid: str, tokens: list[int], blocks: list[int], computed: int) -> CachedRequestData:
    return CachedRequestData(rid, tokens, blocks, computed)


def so_of(sched: dict[str, int], new_reqs=(), cached_reqs=(), finished=()) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=list(cached_reqs),
                           num_scheduled_tokens=sched, total_num_scheduled_tokens=sum(sched.values()),
                           finished_req_ids=list(finished))


A = list(range(1, 11))  # 10 tokens
B = list(range(20, 26))  # 6


def scripted_steps() -> list[SchedulerOutput]:
    return [
        # A: first chunk of its prompt; B: whole prompt (prompt logprobs)
        so_of({"A": 6, "B": 6}, [new("A", A, [7, 3]), new("B", B, [9, 12], prompt_logprobs=1)]),
        # A: the rest of its prompt (a new block); B decodes its first sampled token
        so_of({"A": 4, "B": 1}, cached_reqs=[cached("A", [], [5], 6), cached("B", [40], [], 6)]),
        # both decode; B grows a block; C arrives with a prefix-cache hit of one block
        so_of({"A": 1, "B": 1, "C": 3},
              [new("C", A[:4] + [77, 78, 79], [7, 14], computed=4)],
              [cached("A", [50], [], 10), cached("B", [41], [2], 7)]),
        # A finished (its row freed); B preempted (freed too); D takes a freed row
        so_of({"C": 1, "D": 5}, [new("D", [1, 2, 3, 4, 5], [20, 21])],
              [cached("C", [80], [], 7)], finished=["A", "B"]),
        # B resumed: prompt + its two outputs recomputed, in a new row; C grows
        so_of({"B": 8, "C": 1, "D": 1},
              [new("B", B, [30, 31], out=[40, 41], prompt_logprobs=1)],
              [cached("C", [81], [15], 8), cached("D", [60], [], 5)]),
        # everyone decodes
        so_of({"B": 1, "C": 1, "D": 1},
              cached_reqs=[cached("B", [42], [32], 8), cached("C", [82], [], 9), cached("D", [61], [], 6)]),
        # an abort (C) and a step of one
        so_of({"D": 1}, cached_reqs=[cached("D", [62], [], 7)], finished=["C", "B"]),
    ]


@pytest.mark.parametrize("separate", [False, True], ids=["cpu", "staged"])
def test_scripted_add_finish_preempt_resume_grow(separate: bool) -> None:
    runner = make_runner(separate)
    shadow = Shadow()
    rows_seen: dict[str, list[int]] = {}
    for so in scripted_steps():
        runner._update_states(so)
        shadow.update(so)
        batch = runner._prepare(so)
        check_step(batch, shadow.step(so), runner)
        check_rows(runner)
        for rid, st in runner.requests.items():
            rows_seen.setdefault(rid, [])
            if not rows_seen[rid] or rows_seen[rid][-1] != st.row:
                rows_seen[rid].append(st.row)
    # B was preempted and resumed in another row; D reused a row freed by A or B.
    assert len(rows_seen["B"]) == 2
    assert rows_seen["D"][0] in rows_seen["A"] + rows_seen["B"][:1]
    assert runner.input_batch._num_rows == 3  # never more than three requests at once


def test_block_ids_checked_where_they_enter() -> None:
    runner = make_runner(False, num_blocks=16)
    with pytest.raises(ValueError, match="outside the KV cache"):
        runner._update_states(so_of({"A": 6}, [new("A", A, [7, 16])]))
    with pytest.raises(ValueError, match="outside the KV cache"):
        runner.input_batch.add_request("X", [-1])
    with pytest.raises(ValueError, match="outside the KV cache"):
        runner.input_batch.add_request("Y", list(range(10)) + [99])
    runner._update_states(so_of({"A": 6}, [new("A", A, [7, 3])]))
    with pytest.raises(ValueError, match="outside the KV cache"):
        runner._update_states(so_of({"A": 4}, cached_reqs=[cached("A", [], [16], 6)]))


@pytest.mark.parametrize("separate", [False, True], ids=["cpu", "staged"])
def test_buffers_grow_past_the_sizes_given(separate: bool) -> None:
    """A step beyond max_num_seqs / max_num_batched_tokens / the widest table still builds
    exactly (the buffers are reallocated; a captured graph would be dropped)."""
    runner = make_runner(separate, max_num_seqs=2, max_tokens=4, max_model_len=8)
    shadow = Shadow()
    gen = runner.input_batch.generation
    prompts = {f"r{i}": list(range(i, i + 13)) for i in range(5)}
    so = so_of({r: 13 for r in prompts},
               [new(r, p, [4 * i + j for j in range(4)]) for i, (r, p) in enumerate(prompts.items())])
    runner._update_states(so)
    shadow.update(so)
    check_step(runner._prepare(so), shadow.step(so), runner)
    check_rows(runner)
    assert runner.input_batch.generation > gen


@pytest.mark.parametrize("separate", [False, True], ids=["cpu", "staged"])
def test_padding_for_a_graph_replay(separate: bool) -> None:
    """A decode batch of 3 padded to 8: real rows as built, then token 0, position 0, slot -1,
    seq_len 1, query_start_loc continuing one per sequence, the all-zero block table row."""
    ib = InputBatch(max_num_seqs=8, max_num_batched_tokens=16, max_model_len=32, block_size=BS,
                    device=torch.device("cpu"), num_blocks=40, separate_staging=separate)
    rows = [ib.add_request("a", [5, 6]), ib.add_request("b", [7]), ib.add_request("c", [8, 9, 10])]
    # Dirty the buffers first with a larger mixed step, so stale values would show.
    more = [ib.add_request(r, [11 + i, 12 + i]) for i, r in enumerate("def")]
    ib.prepare(rows + more, [0] * 6, [5, 4, 7, 2, 3, 6], list(range(1, 28)))
    for r in "def":
        ib.remove_request(r)
    step = ib.prepare(rows, [5, 2, 9], [1, 1, 1], [11, 12, 13], pad_to=8)
    assert step.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert step.positions.tolist() == [5, 2, 9, 0, 0, 0, 0, 0]
    assert step.slot_mapping.tolist() == [6 * BS + 1, 7 * BS + 2, 10 * BS + 1, -1, -1, -1, -1, -1]
    assert step.seq_lens.tolist() == [6, 3, 10, 1, 1, 1, 1, 1]
    assert step.query_start_loc.tolist() == list(range(9))
    assert step.query_start_loc_list == [0, 1, 2, 3] and step.seq_lens_list == [6, 3, 10]
    assert step.num_tokens == 3 and step.num_seqs == 3
    table = step.block_table.numpy()
    assert table.shape[0] == 8
    expected = np.zeros((8, table.shape[1]), dtype=np.int64)
    expected[0, :2], expected[1, :1], expected[2, :3] = [5, 6], [7], [8, 9, 10]
    np.testing.assert_array_equal(table, expected)
    if separate:  # fixed width: what a captured graph reads
        assert table.shape[1] == ib.max_blocks and step.block_table.data_ptr() == ib.step_table.data_ptr()


# ------------------------------------------------------------------ scheduler-driven


def fake_token(tokens: list[int]) -> int:
    return (sum(tokens) * 31 + len(tokens)) % 50


def drive(sched: Scheduler, runner: ModelRunner, steps: int, check: bool = True,
          aborts: dict[int, str] | None = None) -> int:
    """Run the scheduler against the runner's state and step building (no model); returns
    how many preemptions happened."""
    shadow = Shadow()
    for step in range(steps):
        if aborts and step in aborts:
            sched.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        runner._update_states(so)
        shadow.update(so)
        if so.total_num_scheduled_tokens == 0:
            continue
        batch = runner._prepare(so)
        if check:
            check_step(batch, shadow.step(so), runner)
            check_rows(runner)
        sampled = []
        for i, rid in enumerate(batch.req_ids):
            r = shadow.reqs[rid]
            sampled.append([fake_token(r.tokens)] if i in batch.sample_rows else [])
        sched.update_from_output(so, ModelRunnerOutput(req_ids=batch.req_ids, sampled_token_ids=sampled))
    return sched.num_preemptions


@pytest.mark.parametrize("separate", [False, True], ids=["cpu", "staged"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scheduler_driven_steps_match_reference(separate: bool, seed: int) -> None:
    rng = random.Random(seed)
    sched = Scheduler(max_num_seqs=6, max_num_batched_tokens=24, block_size=BS, num_kv_blocks=24,
                      max_model_len=64)
    runner = make_runner(separate, max_num_seqs=6, max_tokens=24, max_model_len=64, num_blocks=24)
    for i in range(14):
        prompt = [rng.randrange(1, 50) for _ in range(rng.randint(1, 30))]
        if i % 4 == 1:  # shared prefixes: prefix-cache hits
            prompt = [1, 2, 3, 4, 5, 6, 7, 8] + prompt
        sp = SamplingParams(max_tokens=rng.randint(1, 20), ignore_eos=True,
                            prompt_logprobs=1 if i % 5 == 2 else None)
        sched.add_request(Request(f"r{i}", prompt, sp, max_model_len=64))
    preemptions = drive(sched, runner, 400, aborts={7: "r3", 15: "r9"})
    assert not sched.has_unfinished_requests()
    assert preemptions > 0  # the small cache forces some


# ------------------------------------------------------------------ identical results


class LegacyRunner(ModelRunner):
    """The runner's former step building: fresh tensors from per-token Python lists."""

    def _prepare(self, so: SchedulerOutput) -> _Batch:
        bs = self.block_size
        req_ids = list(so.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        tokens, positions, slots, qsl, seq_lens = [], [], [], [0], []
        sample_rows, logits_indices, prompt_lp = [], [], []
        max_blocks = max(len(st.block_ids) for st in states)
        block_table = np.zeros((len(states), max_blocks), dtype=np.int64)
        for i, st in enumerate(states):
            n = so.num_scheduled_tokens[st.req_id]
            start, end = st.num_computed_tokens, st.num_computed_tokens + so.num_scheduled_tokens[st.req_id]
            tokens.extend(st.token_ids[start:end])
            block_table[i, : len(st.block_ids)] = st.block_ids
            pos = list(range(start, end))
            positions += pos
            slots += [st.block_ids[p // bs] * bs + p % bs for p in pos]
            qsl.append(qsl[-1] + n)
            seq_lens.append(end)
            if st.sampling_params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1:
                prompt_lp.append((st.req_id, qsl[i], min(end, st.num_prompt_tokens - 1) - start, start + 1))
            if end >= len(st.token_ids):
                sample_rows.append(i)
                logits_indices.append(qsl[-1] - 1)
        for _, first, rows, _ in prompt_lp:
            logits_indices += range(first, first + rows)
        meta = AttentionMetadata.build(torch.tensor(slots), qsl, seq_lens, torch.from_numpy(block_table), bs)
        return _Batch(req_ids, torch.tensor(tokens), torch.tensor(positions), meta, sample_rows,
                      torch.tensor(logits_indices, dtype=torch.long), prompt_lp,
                      {rid: i for i, rid in enumerate(so.structured_output_request_ids)}, so.grammar_bitmask,
                      None, len(tokens))


def test_same_tokens_and_logprobs_as_the_former_step_building(tiny_model_dir: str) -> None:
    from tidal.worker.hf_config import load_hf_config
    from tidal.worker.loader import load_model

    cfg = load_hf_config(tiny_model_dir)
    model = load_model(tiny_model_dir, cfg, torch.float32)
    results = []
    for runner_cls, separate in ((LegacyRunner, False), (ModelRunner, False), (ModelRunner, True)):
        rng = random.Random(5)
        sched = Scheduler(max_num_seqs=5, max_num_batched_tokens=40, block_size=BS, num_kv_blocks=30,
                          max_model_len=96)
        runner = runner_cls(model, block_size=BS, vocab_size=cfg.vocab_size, device=torch.device("cpu"),
                            max_num_seqs=5, max_num_batched_tokens=40, max_model_len=96)
        if separate:
            runner.input_batch = InputBatch(max_num_seqs=5, max_num_batched_tokens=40, max_model_len=96,
                                            block_size=BS, device=torch.device("cpu"), separate_staging=True)
        runner.bind_kv_cache(30, torch.float32)
        for i in range(9):
            prompt = [rng.randrange(3, cfg.vocab_size) for _ in range(rng.randint(2, 50))]
            sp = SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True, temperature=0.0 if i % 2 else 0.8,
                                seed=i, logprobs=2 if i % 3 == 0 else None,
                                prompt_logprobs=1 if i % 4 == 1 else None)
            sched.add_request(Request(f"r{i}", prompt, sp, max_model_len=96))
        tokens: dict[str, list[int]] = {}
        lps: list[np.ndarray] = []
        while sched.has_unfinished_requests():
            so = sched.schedule()
            out = runner.execute_model(so)
            for rid, t in zip(out.req_ids, out.sampled_token_ids):
                tokens.setdefault(rid, []).extend(t)
            lps += [a.logprobs for a in out.logprobs.values()] + [a.logprobs for a in out.prompt_logprobs.values()]
            sched.update_from_output(so, out)
        results.append((tokens, lps, sched.num_preemptions))
    (t0, l0, p0), *rest = results
    assert p0 > 0
    for t, lp, p in rest:
        assert t == t0 and p == p0
        assert len(lp) == len(l0)
        for a, b in zip(lp, l0):
            np.testing.assert_array_equal(a, b)
