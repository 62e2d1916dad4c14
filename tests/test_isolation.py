"""Per-request isolation in the step (issue 12, Build 2): a failure that one request explains
(its sampling, or building its output) fails that request alone with an ERROR output; the step
completes for the others, whose tokens are those of an undisturbed run, and the engine goes on
serving. A failure no single request explains still stops the engine.

The faults are injected by tests/fault_injection.py: the sampler (or the scheduler's update)
raises for any request whose prompt holds the token CULPRIT."""
from __future__ import annotations

import asyncio
import random
import subprocess
from typing import Any

import pytest

from engine_utils import (
    assert_all_blocks_free,
    greedy,
    make_core,
    model_path,
    random_prompt,
    req,
    run_to_completion,
    run_with_culprits,
)
from fault_injection import core_command, use_sampling_fault, use_update_fault
from tidal.frontend import AsyncLLM
from tidal.protocol import EngineConfig, EngineGenerateError, EngineOverloadedError, RequestOutputKind, SamplingParams
from tidal.protocol.messages import EngineCoreRequest, FinishReason

try:
    from conftest import free_tcp_port
    from test_wire_faults import reap
except ImportError:  # tests/ made a package
    from tests.conftest import free_tcp_port  # type: ignore[no-redef]
    from tests.test_wire_faults import reap  # type: ignore[no-redef]

M = "tiny"
CULPRIT = 7  # the token id the fault hooks look for in a prompt
MAX_TOKENS = 12


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [t for t in random_prompt(rng, n) if t != CULPRIT]


def good_requests() -> list[EngineCoreRequest]:
    """Greedy and seeded random rows, with logprobs and penalties (which use the sampler's
    scratch count table) among them: every sampler path shares the failing batch."""
    rng = random.Random(5)
    params = [
        greedy(MAX_TOKENS),
        greedy(MAX_TOKENS, logprobs=3),
        SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=20, seed=12, frequency_penalty=0.5, presence_penalty=0.3,
                       max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.7, top_p=0.9, seed=13, repetition_penalty=1.2, min_tokens=4,
                       max_tokens=MAX_TOKENS, ignore_eos=True),
    ]
    return [req(f"good-{i}", _prompt(rng, 5 + 3 * i), p) for i, p in enumerate(params)]


def culprits(n: int) -> list[EngineCoreRequest]:
    rng = random.Random(9)
    return [req(f"bad-{i}", _prompt(rng, 6) + [CULPRIT] + _prompt(rng, 3),
                SamplingParams(temperature=0.8, seed=20 + i, max_tokens=MAX_TOKENS, ignore_eos=True))
            for i in range(n)]


@pytest.fixture(scope="module")
def reference() -> Any:
    """The good requests' results on an undisturbed engine (no fault, no culprit)."""
    return run_to_completion(make_core(M), good_requests())


def _assert_good_undisturbed(run: Any, reference: Any) -> None:
    for rid, ref in reference.results.items():
        got = run[rid]
        assert got.finish_reason == FinishReason.LENGTH and got.tokens == ref.tokens, rid
        if ref.logprobs is not None:
            assert got.logprobs is not None
            assert (got.logprobs.token_ids == ref.logprobs.token_ids).all(), rid
            assert (got.logprobs.logprobs == ref.logprobs.logprobs).all(), rid


@pytest.mark.parametrize("num_culprits", [1, 2])
def test_sampling_failure_fails_the_culprit_alone(monkeypatch: pytest.MonkeyPatch, reference: Any,
                                                  num_culprits: int) -> None:
    use_sampling_fault(monkeypatch, CULPRIT)
    core = make_core(M)
    run = run_with_culprits(core, good_requests(), culprits(num_culprits), "sampling failed",
                            "injected sampling failure")
    _assert_good_undisturbed(run, reference)
    assert_all_blocks_free(core)
    # The engine keeps serving: the same requests again, undisturbed.
    _assert_good_undisturbed(run_to_completion(core, good_requests()), reference)
    assert_all_blocks_free(core)


def test_a_lone_failing_request_fails_alone(monkeypatch: pytest.MonkeyPatch, reference: Any) -> None:
    """A batch of one row that fails: that request is the only explanation."""
    use_sampling_fault(monkeypatch, CULPRIT)
    core = make_core(M)
    run = run_to_completion(core, culprits(1))
    assert run["bad-0"].finish_reason == FinishReason.ERROR
    _assert_good_undisturbed(run_to_completion(core, good_requests()), reference)


def test_failure_of_every_row_stops_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every row fails on its own too: no single request explains that, so the step raises
    (and the core process turns it into engine_dead for every front-end)."""
    use_sampling_fault(monkeypatch, CULPRIT)
    core = make_core(M)
    for r in culprits(3):
        core.add_request(r)
    with pytest.raises(IndexError, match="injected sampling failure"):
        for _ in range(10):
            core.step()


def test_update_failure_fails_the_culprit_alone(monkeypatch: pytest.MonkeyPatch, reference: Any) -> None:
    use_update_fault(monkeypatch, CULPRIT)
    core = make_core(M)
    requests = good_requests()
    requests[2:2] = culprits(1)
    run = run_to_completion(core, requests)
    got = run["bad-0"]
    assert got.finish_reason == FinishReason.ERROR and got.tokens == [], got
    assert "building this request's output failed" in (got.error or "")
    _assert_good_undisturbed(run, reference)
    assert_all_blocks_free(core)
    _assert_good_undisturbed(run_to_completion(core, good_requests()), reference)


# ------------------------------------------------------------------ through a front-end


async def _tokens(engine: AsyncLLM, r: EngineCoreRequest) -> list[int]:
    params = r.sampling_params.clone(output_kind=RequestOutputKind.DELTA)
    ids: list[int] = []
    async for out in engine.generate({"prompt_token_ids": r.prompt_token_ids}, params, r.request_id):
        ids += out.outputs[0].token_ids
    return ids


async def test_front_end_sees_the_culprit_fail_and_the_others_complete(no_leaked_cores: None) -> None:
    """A headless core with the sampling fault: the culprit's stream raises EngineGenerateError
    (not EngineOverloadedError) with the core's words; the others' tokens are those of the
    same requests run before on that core without the culprit; the engine serves on."""
    path = model_path(M)
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    config = EngineConfig(model=path, dtype="float32", device="cpu")
    core = subprocess.Popen([*core_command(CULPRIT), "--address", address, "--config-json", config.to_json().decode()])
    try:
        engine = AsyncLLM(model=path, core_address=address, engine_start_timeout_s=120)
        try:
            goods = good_requests()
            undisturbed = await asyncio.wait_for(asyncio.gather(*(_tokens(engine, r) for r in goods)), 120)
            tasks = [asyncio.ensure_future(_tokens(engine, r)) for r in goods + culprits(1)]
            results = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 120)
            failure = results[-1]
            assert isinstance(failure, EngineGenerateError) and not isinstance(failure, EngineOverloadedError)
            assert "sampling failed" in str(failure)
            assert results[:-1] == undisturbed
            assert all(len(t) == MAX_TOKENS for t in undisturbed)
            assert not engine.errored
            again = await asyncio.wait_for(asyncio.gather(*(_tokens(engine, r) for r in goods)), 120)
            assert again == undisturbed
        finally:
            engine.shutdown()
        assert core.poll() is None, "the core must survive the failed request"
    finally:
        reap(core)
    assert core.returncode == 0
