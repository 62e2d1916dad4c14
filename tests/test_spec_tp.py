"""Speculative decoding under tensor parallelism (issue 33): the n-gram's proposal rows reach
every rank with the scheduler output, and a draft model runs in every rank's worker (sharded
as the target is, its forward has the target's collectives: vLLM's layout). TP=2 with
speculation gives exactly the tokens TP=1 gives without it, greedy and seeded, proposals are
accepted, and every block is free afterwards."""
from __future__ import annotations

import pytest

from engine_utils import assert_all_blocks_free, greedy, make_core, req, run_to_completion
from test_spec_decode import (CORE_KW, accepted, assert_same, core_off, draft_model, model,  # noqa: F401 - fixtures
                              repeating_prompts, spec_config)
from tidal.core.engine_core import EngineCore
from tidal.protocol import SamplingParams

TP_KW = dict(CORE_KW, tensor_parallel_size=2, engine_start_timeout_s=120.0, worker_step_timeout_s=60.0)


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_tp2_with_speculation_matches_tp1_without(model: str, draft_model: str, core_off: EngineCore,
                                                  kind: str) -> None:
    prompts = repeating_prompts(5, 4)
    requests = [req(f"{kind}{i}", p, greedy(40) if i % 2 else
                    SamplingParams(temperature=0.8, seed=7 + i, max_tokens=40, ignore_eos=True))
                for i, p in enumerate(prompts)]
    off = run_to_completion(core_off, requests)
    core = make_core(model, speculative_config=spec_config(kind, draft_model), **TP_KW)
    try:
        on = run_to_completion(core, requests)
        assert_same(off, on)
        assert all(len(r.tokens) == 40 for r in on.results.values())
        assert accepted(core) > 0
        assert_all_blocks_free(core)
    finally:
        core.shutdown()
