"""Scheduler: exact chunked-prefill schedules, prefix caching, preemption, stops, and a
randomized invariant test driven by a fake (torch-free) model runner that simulates the KV
cache contents, so a wrongly shared, lost or overwritten block changes its output."""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import pytest

from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler import Scheduler
from tidal.protocol import EngineConfig, SamplingParams
from tidal.protocol.messages import (
    EngineCoreEventType,
    EngineCoreOutput,
    FinishReason,
    LogprobsArrays,
    ModelRunnerOutput,
    SchedulerOutput,
)

VOCAB = 50


def next_token(fps: list[int]) -> int:
    """The fake model: a function of the whole token history (via its fingerprint)."""
    return (fps[-1] >> 7) % VOCAB


def fingerprints(tokens: list[int]) -> list[int]:
    fps: list[int] = []
    for t in tokens:
        fps.append(hash((fps[-1] if fps else 0, t)))
    return fps


@dataclass
class _RunnerReq:
    tokens: list[int]
    blocks: list[int]
    computed: int
    fps: list[int] = field(default_factory=list)


class FakeRunner:
    """Holds per-request state exactly as the SchedulerOutput contract says, "writes" the KV of
    every scheduled position (the fingerprint of the prefix ending there) into its block slot,
    and before sampling checks that every position of the sequence reads back correctly."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.reqs: dict[str, _RunnerReq] = {}
        self.kv: dict[tuple[int, int], int] = {}
        self.dropped: list[tuple[str, int]] = []  # (req_id, computed when dropped)
        self.eos_by_id: dict[str, int | None] = {}  # expected NewRequestData.eos_token_id

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        bs = self.block_size
        for rid in so.finished_req_ids:
            st = self.reqs.pop(rid, None)
            if st is not None:
                self.dropped.append((rid, st.computed))
        for n in so.scheduled_new_reqs:
            assert n.req_id not in self.reqs
            assert n.eos_token_id == self.eos_by_id.get(n.req_id, n.eos_token_id)
            assert n.num_computed_tokens % bs == 0
            self.reqs[n.req_id] = _RunnerReq(
                list(n.prompt_token_ids) + list(n.output_token_ids), list(n.block_ids), n.num_computed_tokens
            )
        for c in so.scheduled_cached_reqs:
            st = self.reqs[c.req_id]
            st.tokens += c.new_token_ids
            st.blocks += c.new_block_ids
            assert st.computed == c.num_computed_tokens
        assert set(so.num_scheduled_tokens) == {n.req_id for n in so.scheduled_new_reqs} | {
            c.req_id for c in so.scheduled_cached_reqs
        }
        for rid, n in so.num_scheduled_tokens.items():  # the batched forward: write all KV
            st = self.reqs[rid]
            assert n > 0 and st.computed + n <= len(st.tokens)
            assert len(st.blocks) * bs >= st.computed + n
            assert len(set(st.blocks)) == len(st.blocks)
            st.fps = fingerprints(st.tokens)
            for p in range(st.computed, st.computed + n):
                self.kv[(st.blocks[p // bs], p % bs)] = st.fps[p]
        req_ids, sampled = [], []
        for rid, n in so.num_scheduled_tokens.items():  # then attend over the whole prefix
            st = self.reqs[rid]
            st.computed += n
            for p in range(st.computed):
                assert self.kv.get((st.blocks[p // bs], p % bs)) == st.fps[p], (rid, p)
            req_ids.append(rid)
            sampled.append([next_token(st.fps)] if st.computed == len(st.tokens) else [])
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)


def make_req(rid: str, prompt: list[int], eos: int | None = None, max_model_len: int = 1024,
             priority: int = 0, arrival_time: float = 0.0, **sp: object) -> Request:
    return Request(rid, prompt, SamplingParams(**sp), eos_token_id=eos, arrival_time=arrival_time,
                   max_model_len=max_model_len, priority=priority)


def make_sched(**kw: object) -> Scheduler:
    args: dict[str, object] = dict(
        max_num_seqs=8, max_num_batched_tokens=64, block_size=4, num_kv_blocks=64, max_model_len=128
    )
    args.update(kw)
    return Scheduler(**args)  # type: ignore[arg-type]


def update(sched: Scheduler, so: SchedulerOutput, ro: ModelRunnerOutput) -> list[EngineCoreOutput]:
    """update_from_output for requests of no client (make_req's): all grouped under None."""
    by_client = sched.update_from_output(so, ro)
    assert set(by_client) <= {None}, by_client
    return by_client.get(None, [])


def run_steps(sched: Scheduler, runner: FakeRunner) -> Iterator[tuple[SchedulerOutput, list[EngineCoreOutput]]]:
    while sched.has_unfinished_requests():
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        assert so.total_num_scheduled_tokens <= sched.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= sched.max_num_seqs
        yield so, update(sched, so, runner.execute(so))


def run_all(sched: Scheduler, runner: FakeRunner) -> tuple[list[dict[str, int]], dict[str, EngineCoreOutput], dict[str, list[int]]]:
    steps: list[dict[str, int]] = []
    last: dict[str, EngineCoreOutput] = {}
    tokens: dict[str, list[int]] = {}
    for so, outs in run_steps(sched, runner):
        steps.append(dict(so.num_scheduled_tokens))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            last[o.request_id] = o
        assert len(steps) < 10_000
    return steps, last, tokens


def reference_tokens(prompt: list[int], max_tokens: int, eos: int | None = None, min_tokens: int = 0,
                     stop_token_ids: tuple[int, ...] = (), ignore_eos: bool = False,
                     max_model_len: int = 1 << 30) -> list[int]:
    seq, out = list(prompt), []
    while True:
        t = next_token(fingerprints(seq))
        seq.append(t)
        out.append(t)
        if len(out) >= min_tokens and ((t == eos and not ignore_eos) or t in stop_token_ids):
            return out
        if len(out) >= max_tokens or len(seq) >= max_model_len:
            return out


def assert_pool_empty(sched: Scheduler) -> None:
    kv = sched.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert kv.req_to_blocks == {} and not sched.running and not sched.waiting


# ------------------------------------------------------------------ exact schedules


def test_exact_chunked_prefill_schedule() -> None:
    sched = make_sched(max_num_batched_tokens=10)
    sched.add_request(make_req("A", list(range(12)), max_tokens=3))
    sched.add_request(make_req("B", list(range(20, 32)), max_tokens=3))
    steps, last, tokens = run_all(sched, FakeRunner(4))
    assert steps == [
        {"A": 10},
        {"A": 2, "B": 8},
        {"A": 1, "B": 4},
        {"A": 1, "B": 1},  # A's 3rd token: finished
        {"B": 1},
    ]
    assert tokens["A"] == reference_tokens(list(range(12)), 3)
    assert tokens["B"] == reference_tokens(list(range(20, 32)), 3)
    assert last["A"].finish_reason == FinishReason.LENGTH
    assert_pool_empty(sched)


def test_no_chunked_prefill_waits_for_whole_prompt() -> None:
    sched = make_sched(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    sched.add_request(make_req("A", list(range(10)), max_tokens=2))
    sched.add_request(make_req("B", list(range(20, 30)), max_tokens=2))
    steps, _, _ = run_all(sched, FakeRunner(4))
    assert steps == [{"A": 10}, {"A": 1, "B": 10}, {"B": 1}]
    with pytest.raises(ValueError):
        make_sched(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)


def test_max_num_seqs_caps_running() -> None:
    sched = make_sched(max_num_seqs=2)
    for i in range(3):
        sched.add_request(make_req(f"r{i}", [i + 1] * 5, max_tokens=2))
    steps, _, _ = run_all(sched, FakeRunner(4))
    assert steps == [{"r0": 5, "r1": 5}, {"r0": 1, "r1": 1}, {"r2": 5}, {"r2": 1}]


# ------------------------------------------------------------------ prefix caching


def _run_shared_prefix(enable_prefix_caching: bool = True, **sp: object) -> tuple[Scheduler, dict[str, EngineCoreOutput], list[dict[str, int]]]:
    sched = make_sched(enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(4)
    shared = list(range(1, 13))  # 3 blocks of 4
    sched.add_request(make_req("A", shared + [40, 41], max_tokens=2))
    _, last, _ = run_all(sched, runner)
    sched.add_request(make_req("B", shared + [42, 43], max_tokens=2, **sp))
    steps, last2, _ = run_all(sched, runner)
    last.update(last2)
    sched.add_request(make_req("C", list(shared), max_tokens=2, **sp))  # exactly 3 full blocks
    steps3, last3, _ = run_all(sched, runner)
    last.update(last3)
    assert_pool_empty(sched)
    return sched, last, steps + steps3


def test_prefix_caching_shared_prefix() -> None:
    sched, last, steps = _run_shared_prefix()
    assert last["A"].num_cached_tokens == 0
    assert last["B"].num_cached_tokens == 12
    assert last["C"].num_cached_tokens == 8  # last token recomputed: only 2 blocks
    assert steps[0] == {"B": 2} and steps[2] == {"C": 4}
    stats = sched.make_stats()
    assert stats.prefix_cache_hits == 12 + 8
    assert stats.prefix_cache_queries == 14 + 14 + 12
    assert stats.num_prompt_tokens == 14 + 2 + 4


def test_two_requests_prefix_hit_counted_once() -> None:
    sched = make_sched()
    runner = FakeRunner(4)
    shared = list(range(1, 13))
    sched.add_request(make_req("A", shared + [40, 41], max_tokens=3))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    sched.add_request(make_req("B", shared + [42, 43], max_tokens=3))
    _, last, _ = run_all(sched, runner)
    assert last["B"].num_cached_tokens == 12
    assert sched.make_stats().prefix_cache_hits == 12


def test_no_prefix_hit_with_prompt_logprobs_or_caching_off() -> None:
    _, last, _ = _run_shared_prefix(prompt_logprobs=1)
    assert last["B"].num_cached_tokens == 0 and last["C"].num_cached_tokens == 0
    sched, last, _ = _run_shared_prefix(enable_prefix_caching=False)
    assert last["B"].num_cached_tokens == 0 and last["C"].num_cached_tokens == 0
    assert sched.make_stats().prefix_cache_hits == 0


# ------------------------------------------------------------------ preemption


def _run_four(num_kv_blocks: int) -> tuple[Scheduler, dict[str, list[int]], FakeRunner, list[dict[str, int]]]:
    sched = make_sched(num_kv_blocks=num_kv_blocks, max_model_len=32, max_num_batched_tokens=64)
    runner = FakeRunner(4)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", [(i * 7 + j) % VOCAB for j in range(10)], max_tokens=12))
    steps, last, tokens = run_all(sched, runner)
    assert all(o.finish_reason == FinishReason.LENGTH for o in last.values())
    assert_pool_empty(sched)
    return sched, tokens, runner, steps


def test_preemption_recomputes_exactly() -> None:
    big, ref_tokens, _, _ = _run_four(64)
    assert big.num_preemptions == 0
    small, tokens, runner, steps = _run_four(8)
    assert small.num_preemptions > 0
    assert small.make_stats().num_preemptions == small.num_preemptions
    assert tokens == ref_tokens
    assert all(len(t) == 12 for t in tokens.values())
    for rid, t in tokens.items():
        i = int(rid[1:])
        assert t == reference_tokens([(i * 7 + j) % VOCAB for j in range(10)], 12)
    assert any(computed > 0 for _, computed in runner.dropped)


def test_preempted_id_in_finished_req_ids_and_resent_in_full() -> None:
    sched = make_sched(num_kv_blocks=8, max_model_len=32)
    runner = FakeRunner(4)
    for i in range(4):
        sched.add_request(make_req(f"r{i}", [i + 1] * 10, max_tokens=12))
    resumed = 0
    running_before: list[Request] = []
    for so, outs in run_steps(sched, runner):
        preempted = [r for r in running_before if r.status == RequestStatus.PREEMPTED]
        for r in preempted:
            assert r.request_id in so.finished_req_ids
            assert r.num_computed_tokens == 0 and r.num_synced_tokens == 0 and r in sched.waiting
            assert r.request_id not in so.num_scheduled_tokens  # not re-admitted the same step
        for n in so.scheduled_new_reqs:
            if n.output_token_ids:
                resumed += 1
                assert n.output_token_ids == sched.requests[n.req_id].output_token_ids[: len(n.output_token_ids)]
        running_before = list(sched.running)
    assert resumed > 0 and resumed <= sched.num_preemptions


# ------------------------------------------------------------------ scheduling policy


def _admission_order(policy: str) -> list[str]:
    """One seat (max_num_seqs=1): the order requests are admitted in is the queue's order."""
    sched = make_sched(max_num_seqs=1, policy=policy)
    for rid, priority, arrival in (("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0), ("e", 1, 2.0)):
        sched.add_request(make_req(rid, [1, 2, 3], max_tokens=2, priority=priority, arrival_time=arrival))
    order = [n.req_id for so, _ in run_steps(sched, FakeRunner(4)) for n in so.scheduled_new_reqs]
    assert_pool_empty(sched)
    return order


def test_priority_admits_lowest_value_then_earliest_arrival() -> None:
    # (priority, arrival): b (0, 1), d (0, 3), c (1, 2), e (1, 2: equal, added later), a (2, 0)
    assert _admission_order("priority") == ["b", "d", "c", "e", "a"]
    assert _admission_order("fcfs") == ["a", "b", "c", "d", "e"]  # FCFS ignores priority


def _run_low_then_high(policy: str) -> tuple[Scheduler, list[SchedulerOutput], dict[str, list[int]]]:
    """L (priority 1) runs alone for a step, then H (priority 0) arrives; 6 blocks of 4 run out
    at step 5, when L (first in `running`, so already scheduled) and H both need a block."""
    sched = make_sched(num_kv_blocks=6, max_model_len=24, policy=policy)
    runner = FakeRunner(4)
    prompts = {"L": [1] * 8, "H": [2] * 5}
    sched.add_request(make_req("L", prompts["L"], max_model_len=24, max_tokens=12, priority=1))
    tokens: dict[str, list[int]] = {}
    schedules: list[SchedulerOutput] = []
    for so, outs in run_steps(sched, runner):
        schedules.append(so)
        if len(schedules) == 1:
            sched.add_request(make_req("H", prompts["H"], max_model_len=24, max_tokens=8, priority=0,
                                       arrival_time=1.0))
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert tokens == {"L": reference_tokens(prompts["L"], 12), "H": reference_tokens(prompts["H"], 8)}
    assert_pool_empty(sched)
    return sched, schedules, tokens


def test_priority_preempts_the_lowest_priority_running_request() -> None:
    sched, schedules, _ = _run_low_then_high("priority")
    steps = [dict(so.num_scheduled_tokens) for so in schedules]
    assert steps[:5] == [{"L": 8}, {"L": 1, "H": 5}, {"L": 1, "H": 1}, {"L": 1, "H": 1}, {"L": 1, "H": 1}]
    # Step 5: L got its block first, then H found none: L (the larger (priority, arrival)) is
    # taken back out of the step and preempted; H gets the block and runs to its end.
    assert steps[5:9] == [{"H": 1}] * 4 and schedules[5].finished_req_ids == ["L"]
    assert [c.req_id for c in schedules[5].scheduled_cached_reqs] == ["H"]
    assert schedules[5].scheduled_cached_reqs[0].new_block_ids == [5]  # the block L had taken
    assert schedules[9].scheduled_new_reqs[0].req_id == "L"  # resumed once H is done
    assert sched.num_preemptions == 1


def test_fcfs_preempts_the_tail_whatever_its_priority() -> None:
    sched, schedules, _ = _run_low_then_high("fcfs")
    steps = [dict(so.num_scheduled_tokens) for so in schedules]
    assert steps[5] == {"L": 1} and schedules[5].finished_req_ids == ["H"]  # H was last admitted
    assert steps[5:12] == [{"L": 1}] * 7 and steps[12] == {"H": 5}
    assert sched.num_preemptions == 1


def test_preempted_request_waits_at_its_priority() -> None:
    sched = make_sched(num_kv_blocks=6, max_model_len=24, policy="priority")
    runner = FakeRunner(4)
    sched.add_request(make_req("L", [1] * 8, max_model_len=24, max_tokens=12, priority=1))
    admitted: list[str] = []
    dropped: dict[int, list[str]] = {}  # step -> ids whose runner state it dropped
    for step, (so, _) in enumerate(run_steps(sched, runner)):
        admitted += [n.req_id for n in so.scheduled_new_reqs]
        if so.finished_req_ids:
            dropped[step] = so.finished_req_ids
        if step == 0:
            sched.add_request(make_req("H", [2] * 5, max_model_len=24, max_tokens=8, arrival_time=1.0))
        if step == 5:  # L was just preempted (as above); two more arrive while H runs
            assert [r.request_id for r in sched.waiting] == ["L"]
            sched.add_request(make_req("M", [3] * 4, max_model_len=24, max_tokens=2, priority=2, arrival_time=2.0))
            sched.add_request(make_req("N", [4] * 4, max_model_len=24, max_tokens=2, priority=1, arrival_time=3.0))
            assert [r.request_id for r in sched.waiting] == ["L", "N", "M"]
    # Once H is done, L resumes before N (same priority, earlier arrival), then M. At step 10
    # N needs a block: the victim is M, the lowest priority, admitted last.
    assert admitted == ["L", "H", "L", "N", "M", "M"]
    assert dropped == {5: ["L"], 9: ["H"], 10: ["M"], 11: ["N"], 12: ["M"]}  # 5, 10: preempted
    assert sched.num_preemptions == 2
    assert_pool_empty(sched)


def test_unknown_policy_and_from_config() -> None:
    with pytest.raises(ValueError):
        make_sched(policy="lifo")
    cfg = EngineConfig(scheduling_policy="priority")
    assert Scheduler.from_config(cfg, num_kv_blocks=600, max_model_len=4096).policy.value == "priority"
    assert Scheduler.from_config(EngineConfig(), num_kv_blocks=600, max_model_len=4096).policy.value == "fcfs"


# ------------------------------------------------------------------ stops


def _single(prompt: list[int], eos: int | None = None, max_model_len: int = 128, **sp: object) -> tuple[list[int], EngineCoreOutput]:
    sched = make_sched(max_model_len=max_model_len)
    sched.add_request(make_req("r", prompt, eos=eos, max_model_len=max_model_len, **sp))
    _, last, tokens = run_all(sched, FakeRunner(4))
    assert_pool_empty(sched)
    return tokens["r"], last["r"]


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_stop_on_eos_and_ignore_eos() -> None:
    free_run = reference_tokens(PROMPT, 20)
    eos = free_run[4]
    k = free_run.index(eos)
    toks, out = _single(PROMPT, eos=eos, max_tokens=20)
    assert toks == free_run[: k + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason is None
    toks, out = _single(PROMPT, eos=eos, max_tokens=20, ignore_eos=True)
    assert toks == free_run and out.finish_reason == FinishReason.LENGTH


def test_stop_token_ids_and_min_tokens() -> None:
    free_run = reference_tokens(PROMPT, 20)
    stop = free_run[2]
    k = free_run.index(stop)
    toks, out = _single(PROMPT, max_tokens=20, stop_token_ids=[stop])
    assert toks == free_run[: k + 1]
    assert out.finish_reason == FinishReason.STOP and out.stop_reason == stop
    # min_tokens past the first occurrence delays the stop (eos too).
    toks, out = _single(PROMPT, eos=stop, max_tokens=20, min_tokens=k + 2)
    expect = reference_tokens(PROMPT, 20, eos=stop, min_tokens=k + 2)
    assert toks == expect and len(toks) >= k + 2
    toks, out = _single(PROMPT, max_tokens=20, min_tokens=k + 2, stop_token_ids=[stop])
    assert toks == reference_tokens(PROMPT, 20, stop_token_ids=(stop,), min_tokens=k + 2)


def test_max_tokens_and_max_model_len() -> None:
    toks, out = _single(PROMPT, max_tokens=5)
    assert len(toks) == 5 and out.finish_reason == FinishReason.LENGTH
    toks, out = _single(PROMPT, max_tokens=None, max_model_len=16)
    assert len(toks) == 8 and out.finish_reason == FinishReason.LENGTH
    toks, out = _single(PROMPT, max_tokens=30, max_model_len=12)
    assert len(toks) == 4 and out.finish_reason == FinishReason.LENGTH


# ------------------------------------------------------------------ aborts, misc


def test_abort_frees_and_reports() -> None:
    sched = make_sched(max_num_batched_tokens=8)
    runner = FakeRunner(4)
    sched.add_request(make_req("A", list(range(12)), max_tokens=5))
    sched.add_request(make_req("B", list(range(12)), max_tokens=5))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    ended = sched.finish_requests(["A", "B", "nope"], RequestStatus.FINISHED_ABORTED)
    assert [r.request_id for r in ended] == ["A", "B"]
    assert ended[0].get_finished_reason() == FinishReason.ABORT
    assert not sched.has_unfinished_requests()
    assert_pool_empty(sched)
    so = sched.schedule()
    assert so.finished_req_ids == ["A"]  # B never reached the runner
    assert so.total_num_scheduled_tokens == 0
    assert sched.finish_requests("A", RequestStatus.FINISHED_ABORTED) == []


def test_from_config() -> None:
    cfg = EngineConfig(max_num_seqs=3, block_size=8, enable_chunked_prefill=False)
    sched = Scheduler.from_config(cfg, num_kv_blocks=600, max_model_len=4096)
    assert sched.max_num_batched_tokens == 4096 and sched.max_num_seqs == 3  # a prompt fits a step
    assert not sched.log_stats  # stats are off by default
    with pytest.raises(ValueError, match="fewer than max_model_len=4096"):
        Scheduler.from_config(cfg, num_kv_blocks=10, max_model_len=4096)
    sched = Scheduler.from_config(EngineConfig(disable_log_stats=False), num_kv_blocks=600, max_model_len=4096)
    assert sched.max_num_batched_tokens == 2048 and sched.log_stats


def test_outputs_carry_logprobs_and_events() -> None:
    sched = make_sched(max_num_batched_tokens=8, log_stats=True)
    sched.add_request(make_req("A", list(range(12)), max_tokens=2, prompt_logprobs=1))
    runner = FakeRunner(4)
    so = sched.schedule()
    ro = runner.execute(so)
    rows = LogprobsArrays(np.zeros((8, 2), np.int32), np.zeros((8, 2), np.float32), np.ones(8, np.int32))
    ro.prompt_logprobs = {"A": rows}  # the first chunk: prompt positions 1..8
    outs = update(sched, so, ro)
    assert len(outs) == 1 and outs[0].new_token_ids == [] and outs[0].new_prompt_logprobs is rows
    kinds = [k for k, _ in outs[0].events or []]
    assert kinds == [EngineCoreEventType.QUEUED, EngineCoreEventType.SCHEDULED]
    so = sched.schedule()
    ro = runner.execute(so)
    marker = object()
    ro.logprobs = {"A": marker}  # type: ignore[dict-item]
    outs = update(sched, so, ro)
    assert outs[0].new_token_ids and outs[0].new_logprobs is marker and outs[0].events is None


def test_events_only_with_stats() -> None:
    """QUEUED, SCHEDULED and PREEMPTED are recorded (and shipped) only with log_stats."""
    for log_stats in (False, True):
        sched = make_sched(num_kv_blocks=8, max_model_len=32, log_stats=log_stats)
        for i in range(4):
            sched.add_request(make_req(f"r{i}", [i + 1] * 10, max_tokens=12))
        kinds = {k for _, outs in run_steps(sched, FakeRunner(4)) for o in outs for k, _ in o.events or []}
        assert sched.num_preemptions > 0
        assert kinds == (set(EngineCoreEventType) if log_stats else set()), log_stats


def test_outputs_grouped_by_client() -> None:
    """Each output goes to the front-end that sent its request (Request.client_index)."""
    sched = make_sched()
    for rid, client in (("a1", b"fe-a"), ("b1", b"fe-b"), ("a2", b"fe-a"), ("local", None)):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=2), client_index=client))
    so = sched.schedule()
    by_client = sched.update_from_output(so, FakeRunner(4).execute(so))
    assert {c: [o.request_id for o in outs] for c, outs in by_client.items()} == {
        b"fe-a": ["a1", "a2"], b"fe-b": ["b1"], None: ["local"]}


# ------------------------------------------------------------------ randomized invariants


def _random_case(seed: int, policy: str = "fcfs") -> None:
    rng = random.Random(seed)
    priority_rng = random.Random(~seed)  # a separate stream: the FCFS cases stay as they were
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.randint(8, 48)
    chunked = rng.random() < 0.8
    budget = rng.randint(1, 40) if chunked else rng.randint(max_model_len, max_model_len + 20)
    num_kv_blocks = -(-max_model_len // block_size) + rng.randint(0, 12)
    sched = Scheduler(
        max_num_seqs=rng.randint(1, 6), max_num_batched_tokens=budget, block_size=block_size,
        num_kv_blocks=num_kv_blocks, max_model_len=max_model_len,
        enable_prefix_caching=rng.random() < 0.8, enable_chunked_prefill=chunked, policy=policy,
    )
    runner = FakeRunner(block_size)
    bases = [[rng.randrange(VOCAB) for _ in range(max_model_len)] for _ in range(2)]
    specs: dict[str, dict[str, object]] = {}
    pending = []
    for i in range(rng.randint(1, 7)):
        plen = rng.randint(1, max_model_len - 1)
        share = rng.randint(0, plen)
        prompt = bases[rng.randrange(2)][:share] + [rng.randrange(VOCAB) for _ in range(plen - share)]
        sp = dict(max_tokens=rng.choice([None, rng.randint(1, 12)]), ignore_eos=rng.random() < 0.2)
        if rng.random() < 0.3:
            sp["stop_token_ids"] = [rng.randrange(VOCAB)]
            sp["min_tokens"] = rng.randint(0, 3) if sp["max_tokens"] is None else rng.randint(0, sp["max_tokens"])
        pending.append((rng.randint(0, 10), f"r{i}", prompt, rng.choice([None, rng.randrange(VOCAB)]), sp))
    tokens: dict[str, list[int]] = {}
    finished: dict[str, EngineCoreOutput] = {}
    aborted: set[str] = set()
    scheduled: dict[str, int] = {}
    hits: dict[str, int] = {}
    step = 0
    while pending or sched.has_unfinished_requests():
        for item in [p for p in pending if p[0] <= step]:
            pending.remove(item)
            _, rid, prompt, eos, sp = item
            specs[rid] = dict(prompt=prompt, eos=eos, **sp)
            runner.eos_by_id[rid] = eos
            sched.add_request(make_req(rid, prompt, eos=eos, max_model_len=max_model_len,
                                       priority=priority_rng.randint(-1, 2), arrival_time=step, **sp))
        if sched.requests and rng.random() < 0.05:
            rid = rng.choice(list(sched.requests))
            (req,) = sched.finish_requests([rid, "unknown"], RequestStatus.FINISHED_ABORTED)
            aborted.add(rid)
        step += 1
        assert step < 5000
        so = sched.schedule()
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= budget
        assert len(so.num_scheduled_tokens) <= sched.max_num_seqs and len(sched.running) <= sched.max_num_seqs
        for n in so.scheduled_new_reqs:
            hits[n.req_id] = hits.get(n.req_id, 0) + n.num_computed_tokens
        for rid, n in so.num_scheduled_tokens.items():
            scheduled[rid] = scheduled.get(rid, 0) + n
        for o in update(sched, so, runner.execute(so)):
            assert o.request_id not in finished
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o
        # Block accounting: ref counts == holders; free queue == unreferenced blocks.
        kv = sched.kv_cache_manager
        refs = [0] * num_kv_blocks
        for blocks in kv.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] += 1
        assert kv.block_pool.ref_counts() == refs
        assert kv.num_free_blocks == refs.count(0)
        assert set(kv.req_to_blocks) == {r.request_id for r in sched.running}
    assert_pool_empty(sched)
    assert set(finished) | aborted == set(specs) and not (set(finished) & aborted)
    so = sched.schedule()  # flush the last finished_req_ids to the runner
    runner.execute(so)
    assert runner.reqs == {}
    drops: dict[str, list[int]] = {}
    for rid, computed in runner.dropped:
        drops.setdefault(rid, []).append(computed)
    for rid, o in finished.items():
        s = specs[rid]
        out = tokens[rid]
        expect = reference_tokens(
            s["prompt"], s["max_tokens"] or max_model_len, eos=s["eos"], min_tokens=s.get("min_tokens", 0),
            stop_token_ids=tuple(s.get("stop_token_ids", ())), ignore_eos=s["ignore_eos"], max_model_len=max_model_len,
        )
        assert out == expect, (seed, rid)
        # Every position but the last sampled token ends computed; each admission computes
        # from its cache hit up to where it was dropped (preempted or finished).
        assert drops[rid][-1] == len(s["prompt"]) + len(out) - 1, (seed, rid)
        assert scheduled[rid] + hits[rid] == sum(drops[rid]), (seed, rid)


@pytest.mark.parametrize("chunk", range(4))
def test_randomized_invariants(chunk: int) -> None:
    for seed in range(chunk * 50, chunk * 50 + 50):
        _random_case(seed)


@pytest.mark.parametrize("chunk", range(2))
def test_randomized_invariants_priority(chunk: int) -> None:
    for seed in range(chunk * 50, chunk * 50 + 50):
        _random_case(seed, "priority")
