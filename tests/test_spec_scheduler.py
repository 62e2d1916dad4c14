"""Speculative decoding without a model (issue 33): the scheduler's rollback of rejected rows
(num_computed_tokens, the blocks that held only them, the prefix cache), a stop inside an
accepted run, when no proposals are made and how their count adapts; the n-gram proposer
against a brute-force reading of vLLM's rule; the engine arg's keys, defaults and refusals.
The engine-level token-identity tests are in test_spec_decode.py."""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from engine_utils import EOS
from tidal.core.block_pool import update_block_hashes
from tidal.core.request import Request, RequestStatus
from tidal.core.scheduler import Scheduler
from tidal.core.spec_decode import ngram_propose
from tidal.frontend.engine_args import EngineArgs
from tidal.protocol import SamplingParams
from tidal.protocol.messages import FinishReason, LogprobsArrays, ModelRunnerOutput
from tidal.protocol.speculative import SpeculativeConfig


# ------------------------------------------------------------------ scheduler alone (no model)


def _scheduler(k: int = 3, blocks: int = 32, budget: int = 64, **kw: Any) -> Scheduler:
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_min=2, prompt_lookup_max=3,
                             disable_by_batch_size=kw.pop("disable_by_batch_size", None))
    return Scheduler(max_num_seqs=8, max_num_batched_tokens=budget, block_size=4, num_kv_blocks=blocks,
                     max_model_len=64, speculative_config=spec, **kw)


def _request(rid: str, prompt: list[int], **params: Any) -> Request:
    params.setdefault("max_tokens", 30)
    return Request(rid, prompt, SamplingParams(temperature=0.0, **params), eos_token_id=EOS)


def _step(s: Scheduler, sampled: dict[str, list[int]], logprobs: bool = False) -> tuple[Any, dict]:
    """Schedule a step and answer it as a runner would, with `sampled` (req_id -> tokens) for
    the requests whose rows reach their last token; returns (the schedule, outputs by id)."""
    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    samples = {r: sampled.get(r, []) for r in ids
               if s.requests[r].num_computed_tokens + so.num_scheduled_tokens[r] >= s.requests[r].num_tokens}
    out = ModelRunnerOutput(req_ids=ids, sampled_token_ids=[samples.get(r, []) for r in ids])
    if logprobs:
        for r, tokens in samples.items():
            n = len(tokens)
            out.logprobs[r] = LogprobsArrays(np.array(tokens, dtype=np.int32)[:, None],
                                             np.zeros((n, 1), np.float32), np.ones(n, np.int32))
    outs = {o.request_id: o for group in s.update_from_output(so, out).values() for o in group}
    return so, outs


def _cached_hashes_ok(s: Scheduler, r: Request) -> None:
    """Every cached block of `r` holds its own tokens: positions below num_computed_tokens."""
    kv = s.kv_cache_manager
    expected: list[int] = []
    n = min(r.num_computed_tokens, r.num_tokens)
    update_block_hashes(expected, r.all_token_ids[:n], kv.block_size)
    for i, block in enumerate(kv.req_to_blocks[r.request_id]):
        if block.block_hash is not None:
            assert i < len(expected) and block.block_hash == expected[i], (i, block)


def _pool_adds_up(s: Scheduler) -> None:
    kv = s.kv_cache_manager
    held = sum(len(kv.held_block_ids(rid)) for rid in s.requests)
    assert kv.num_free_blocks + held == kv.num_blocks


P = [10, 11, 12, 13, 14, 15, 10, 11, 12]  # after its first token (13), "11 12 13" proposes 14 15 10


def test_scheduler_rolls_back_rejected_rows() -> None:
    s = _scheduler()
    r = _request("a", P)
    s.add_request(r)
    so, _ = _step(s, {"a": [13]})  # the prefill
    assert so.scheduled_spec_decode_tokens == {} and r.num_computed_tokens == 9
    so, outs = _step(s, {"a": [14, 15, 99]})  # 14 and 15 accepted, 10 rejected: 99 in its place
    assert so.scheduled_spec_decode_tokens == {"a": [14, 15, 10]} and so.num_scheduled_tokens == {"a": 4}
    assert outs["a"].new_token_ids == [14, 15, 99]
    # Rows 9..11 had the right inputs (13, 14, 15); row 12 (input 10) is rolled back.
    assert r.num_computed_tokens == 12 and r.num_tokens == 13
    assert len(s.kv_cache_manager.req_to_blocks["a"]) == 4  # block 3 is where token 12 goes next
    assert r.num_dropped_blocks == 0
    _cached_hashes_ok(s, r)
    _pool_adds_up(s)
    stats = s.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens, stats.spec_decode_num_accepted_tokens,
            stats.spec_decode_num_accepted_tokens_per_pos) == (1, 3, 2, [1, 1, 0])
    # One accepted: position 11 (input 15, rejected) would complete block 2 with the wrong KV;
    # it is not cached until recomputed.
    s = _scheduler()
    r = _request("b", P)
    s.add_request(r)
    _step(s, {"b": [13]})
    _step(s, {"b": [14, 99]})
    assert r.num_computed_tokens == 11 and r.num_tokens == 12
    # (block 3 held only row 12, rejected: dropped)
    assert [b.block_hash is not None for b in s.kv_cache_manager.req_to_blocks["b"]] == [True, True, False]
    _cached_hashes_ok(s, r)
    _step(s, {"b": [98]})  # position 11 recomputed (input 99): now block 2 is cached
    assert [b.block_hash is not None for b in s.kv_cache_manager.req_to_blocks["b"]][:3] == [True, True, True]
    _cached_hashes_ok(s, r)


def test_scheduler_drops_blocks_of_rejected_rows_and_tells_the_runner() -> None:
    s = _scheduler()
    r = _request("a", P)
    s.add_request(r)
    _step(s, {"a": [13]})
    free = s.kv_cache_manager.num_free_blocks
    so, outs = _step(s, {"a": [50]})  # rows 9..12, all rejected: row 12's block held nothing else
    assert so.scheduled_spec_decode_tokens == {"a": [14, 15, 10]} and so.scheduled_cached_reqs[0].new_block_ids
    assert outs["a"].new_token_ids == [50] and r.num_computed_tokens == 10 and r.num_tokens == 11
    assert len(s.kv_cache_manager.req_to_blocks["a"]) == 3 and s.kv_cache_manager.num_free_blocks == free
    assert r.num_dropped_blocks == 1
    _pool_adds_up(s)
    so, _ = _step(s, {"a": [51]})  # the runner is told to drop it from its table
    assert so.scheduled_cached_reqs[0].num_dropped_blocks == 1 and r.num_dropped_blocks == 0
    _cached_hashes_ok(s, r)
    s.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks


def test_scheduler_stop_inside_the_run() -> None:
    s = _scheduler()
    r = _request("a", P, stop_token_ids=[15], logprobs=0)
    s.add_request(r)
    _step(s, {"a": [13]}, logprobs=True)
    so, outs = _step(s, {"a": [14, 15, 10, 3]}, logprobs=True)  # all accepted, but 15 stops it
    assert so.scheduled_spec_decode_tokens == {"a": [14, 15, 10]}
    out = outs["a"]
    assert out.new_token_ids == [14, 15] and out.finish_reason == FinishReason.STOP and out.stop_reason == 15
    assert out.new_logprobs is not None and out.new_logprobs.token_ids[:, 0].tolist() == [14, 15]
    assert "a" not in s.requests and s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_blocks
    # max_tokens: never more proposals than tokens still allowed (the bonus token is the last)
    s = _scheduler()
    s.add_request(_request("b", P, max_tokens=3))
    _step(s, {"b": [13]})
    so, outs = _step(s, {"b": [14, 15]})
    assert so.scheduled_spec_decode_tokens == {"b": [14]}
    assert outs["b"].new_token_ids == [14, 15] and outs["b"].finish_reason == FinishReason.LENGTH


class _Grammar:
    """Stands in for a structured-output request's grammar state: it forbids `forbidden`."""

    ready = True

    def __init__(self, forbidden: int = -1) -> None:
        self.forbidden = forbidden

    def accept_token(self, token: int) -> bool:
        return token != self.forbidden

    def is_terminated(self) -> bool:
        return False

    def num_valid_proposals(self, proposals: list[int]) -> int:
        return proposals.index(self.forbidden) if self.forbidden in proposals else len(proposals)


def test_scheduler_makes_no_proposals_when_it_cannot_or_should_not() -> None:
    # stop strings speculate (the front-end cuts the tokens after one); structured outputs
    # speculate, cut before the first proposal their grammar forbids; after a draft with
    # nothing accepted, one proposal (adaptive k)
    s = _scheduler()
    s.add_request(_request("stop", P, stop=["x"]))
    s.add_request(_request("plain", P))
    _step(s, {"stop": [13], "plain": [13]})
    so, _ = _step(s, {"stop": [14], "plain": [99]})
    assert so.scheduled_spec_decode_tokens == {"stop": [14, 15, 10], "plain": [14, 15, 10]}
    s.requests["plain"].structured_output_request = _Grammar(forbidden=15)  # type: ignore[assignment]
    s.requests["plain"].all_token_ids[-1] = s.requests["plain"].output_token_ids[-1] = 14  # a match again
    s.requests["plain"].spec_k = None
    so, _ = _step(s, {"stop": [15], "plain": [15]})
    assert so.scheduled_spec_decode_tokens == {"stop": [15]}  # plain: its first proposal, 15, is forbidden
    s.requests["plain"].structured_output_request = _Grammar(forbidden=12)  # type: ignore[assignment]
    so, _ = _step(s, {"stop": [10], "plain": [10]})
    assert so.scheduled_spec_decode_tokens["plain"] == [10, 11]  # "13 14 15" proposes 10 11 12: cut before 12
    # a draft model proposes in the worker, after the core built the masks: none for a grammar
    from tidal.core.spec_decode import SpecDecoder

    drafted = SpecDecoder(SpeculativeConfig.from_value({"method": "draft_model", "model": "unused",
                                                        "num_speculative_tokens": 3}), 256)
    r = s.requests["plain"]
    assert drafted.propose(r, 8) == []
    r.structured_output_request = None
    assert len(drafted.propose(r, 8)) > 0
    # disable_by_batch_size: none while that many requests run
    s = _scheduler(disable_by_batch_size=2)
    s.add_request(_request("x", P, max_tokens=2))
    s.add_request(_request("y", P))
    _step(s, {"x": [13], "y": [13]})
    so, _ = _step(s, {"x": [14], "y": [14]})  # x ends here (max_tokens=2)
    assert so.scheduled_spec_decode_tokens == {}
    so, _ = _step(s, {"y": [99]})
    assert so.scheduled_spec_decode_tokens == {"y": [15, 10, 11]}
    # the token budget caps them
    s = _scheduler(budget=2)
    s.add_request(_request("z", P))
    while s.requests["z"].num_output_tokens == 0:
        _step(s, {"z": [13]})
    so, _ = _step(s, {"z": [99]})
    assert so.scheduled_spec_decode_tokens == {"z": [14]} and so.num_scheduled_tokens == {"z": 2}
    # no n-gram match, none
    s = _scheduler()
    s.add_request(_request("w", [30, 31, 32, 33]))
    _step(s, {"w": [34]})
    so, _ = _step(s, {"w": [35]})
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"w": 1}


def test_proposal_count_adapts_and_a_request_that_never_hits_sits_out() -> None:
    """One more proposal than the last draft's accepted run (up to k); MISS_LIMIT drafts in a
    row with nothing accepted: the request sits out FIRST_BACKOFF steps, then twice as long
    after the next such run; an accepted proposal resets the sit-outs."""
    from tidal.core.spec_decode import FIRST_BACKOFF, MISS_LIMIT, SpecDecoder

    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1, prompt_lookup_max=2), 64)
    r = _request("a", [5, 6, 7] * 6)  # "... 6 7" is always followed by 5 6 7 5
    assert spec.propose(r, 16) == [5, 6, 7, 5]

    def sit_out() -> int:
        n = 0
        while not spec.propose(r, 16):
            n += 1
        return n

    for _ in range(MISS_LIMIT - 1):
        spec.record(len(spec.propose(r, 16)), 0, r)
    assert spec.propose(r, 16) == [5]  # one proposal after a draft of which nothing was accepted
    spec.record(1, 0, r)  # the third miss in a row
    assert sit_out() == FIRST_BACKOFF
    spec.record(1, 1, r)
    assert spec.propose(r, 16) == [5, 6]
    spec.record(2, 2, r)
    assert spec.propose(r, 16) == [5, 6, 7]
    spec.record(3, 1, r)
    assert spec.propose(r, 16) == [5, 6]
    for _ in range(MISS_LIMIT):
        spec.record(len(spec.propose(r, 16)), 0, r)
    assert sit_out() == FIRST_BACKOFF  # an accepted proposal since: the first sit-out's length
    for _ in range(MISS_LIMIT):
        spec.record(len(spec.propose(r, 16)), 0, r)
    assert sit_out() == 2 * FIRST_BACKOFF  # none accepted since: twice as long
    assert (spec.num_drafts, spec.num_accepted_tokens) == (3 * MISS_LIMIT + 3, 4)


def test_scheduler_drops_proposals_before_preempting() -> None:
    s = _scheduler(blocks=16)  # 64 tokens in all
    s.add_request(_request("big", list(range(100, 151))))  # 51 tokens: 13 blocks, no repeated n-gram
    s.add_request(_request("b", P))  # 3 blocks: the pool is full
    _step(s, {"big": [151], "b": [13]})
    assert s.kv_cache_manager.num_free_blocks == 0
    so, _ = _step(s, {"big": [152], "b": [14]})  # b's proposals would need a 4th block
    assert so.num_scheduled_tokens == {"big": 1, "b": 1} and so.scheduled_spec_decode_tokens == {}
    assert s.num_preemptions == 0


# ------------------------------------------------------------------ the n-gram proposer


def _brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """vLLM's rule read literally: the longest n in [lo, hi] whose suffix occurs earlier
    (ending before the last token), its earliest occurrence, the up to k tokens after it."""
    L = len(tokens)
    for n in range(hi, lo - 1, -1):
        for i in range(0, L - n):
            if tokens[i: i + n] == tokens[L - n:]:
                return tokens[i + n: i + n + k]
    return []


def test_ngram_matches_the_rule() -> None:
    assert ngram_propose(np.array([1, 2, 3, 4, 2, 3]), 2, 3, 4) == [4, 2, 3]  # vLLM's docstring example
    assert ngram_propose(np.array([1, 1, 1, 1]), 2, 2, 3) == [1, 1]  # overlapping the suffix
    assert ngram_propose(np.array([5, 6, 7]), 1, 3, 2) == []
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 6])) for _ in range(rng.randrange(0, 30))]
        lo = rng.randrange(1, 4)
        hi = rng.randrange(lo, 6)
        k = rng.randrange(1, 6)
        assert ngram_propose(np.array(tokens, dtype=np.int64), lo, hi, k) == _brute_force(tokens, lo, hi, k), \
            (tokens, lo, hi, k)


# ------------------------------------------------------------------ the engine arg


def test_speculative_config_keys_and_defaults() -> None:
    args = EngineArgs(model="/m", speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    cfg = args.create_engine_config()
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 5, 5, None)  # vLLM's defaults: 5 and 5
    one = SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4})
    assert (one.method, one.prompt_lookup_min, one.prompt_lookup_max) == ("ngram", 4, 4)
    one = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                        "disable_by_batch_size": 8})
    assert (one.prompt_lookup_min, one.prompt_lookup_max, one.disable_by_batch_size) == (2, 2, 8)
    draft = SpeculativeConfig.from_value({"model": "/d", "num_speculative_tokens": 3})
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/d", 3)  # vLLM's inference
    assert SpeculativeConfig.from_value({"method": "draft_model", "model": "/d", "num_speculative_tokens": 2,
                                         "disable_by_batch_size": 4}).disable_by_batch_size == 4
    assert _roundtrip(EngineArgs(model="/m", speculative_config={"model": "/d", "num_speculative_tokens": 3})
                      .create_engine_config()).speculative_config == draft
    assert EngineArgs(model="/m").create_engine_config().speculative_config is None
    assert EngineArgs(model="/m", speculative_config={}).create_engine_config().speculative_config is None
    assert _roundtrip(cfg).speculative_config == cfg.speculative_config
    # the CLI's flag (tidal serve --speculative-config JSON), as vLLM's
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--model", "/m", "--speculative-config",
                            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'])
    assert EngineArgs.from_cli_args(ns).create_engine_config().speculative_config == SpeculativeConfig("ngram", 2, 3, 3)


def _roundtrip(cfg: Any) -> Any:
    from tidal.protocol import EngineConfig

    return EngineConfig.from_json(cfg.to_json())


@pytest.mark.parametrize("value, words", [
    ({"method": "eagle", "model": "x", "num_speculative_tokens": 2}, ["'eagle'", "speculative decoding"]),
    ({"method": "eagle3", "num_speculative_tokens": 2}, ["'eagle3'"]),
    ({"method": "mtp", "num_speculative_tokens": 1}, ["'mtp'"]),
    ({"method": "draft_model", "num_speculative_tokens": 4}, ["'draft_model'", "needs model"]),
    ({"model": "/d", "num_speculative_tokens": 4, "prompt_lookup_max": 3}, ["prompt_lookup_max", "n-gram"]),
    ({"model": "/d", "num_speculative_tokens": 4, "quantization": "fp8"}, ["quantization", "target's dtype"]),
    ({"method": "ngram"}, ["num_speculative_tokens"]),
    ({"method": "ngram", "num_speculative_tokens": 0}, ["num_speculative_tokens", ">= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     ["prompt_lookup_min"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, ["disable_by_batch_size"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2}, ["draft"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 2}, ["unknown", "lookahead"]),
])
def test_speculative_config_refused(value: dict, words: list[str]) -> None:
    with pytest.raises(ValueError) as info:
        EngineArgs(model="/m", speculative_config=value).create_engine_config()
    assert "speculative_config" in str(info.value)
    for w in words:
        assert w in str(info.value), (w, str(info.value))
