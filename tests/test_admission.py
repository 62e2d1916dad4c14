"""Admission control (issue 12, Build 4): with `max_waiting_requests`, a new request that finds
that many requests waiting is refused at once ("engine overloaded"), as EngineOverloadedError
in the front-end and 503 with Retry-After from the server; the requests already admitted are
untouched, and the engine takes new ones again as soon as the queue shrinks."""
from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from typing import Any

import pytest

from engine_utils import greedy, make_core, req, run_to_completion, step_outputs
from tidal.frontend import LLM, AsyncLLM
from tidal.protocol import EngineGenerateError, EngineOverloadedError, SamplingParams
from tidal.protocol.messages import ErrorKind, FinishReason

try:
    from conftest import count_stream_tokens
    from server_utils import Server, assert_openai_error
except ImportError:  # tests/ made a package
    from tests.conftest import count_stream_tokens  # type: ignore[no-redef]
    from tests.server_utils import Server, assert_openai_error  # type: ignore[no-redef]

M = "tiny"


def test_core_refuses_over_the_limit_and_admits_again() -> None:
    core = make_core(M, max_waiting_requests=2, max_num_seqs=1)
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(5)]
    reference = run_to_completion(make_core(M), [req(f"r{i}", p, greedy(4)) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):  # none has been scheduled yet: all five would wait
        core.add_request(req(f"r{i}", p, greedy(4)))
    outs = step_outputs(core)
    refused = {o.request_id: o for o in outs if o.finish_reason == FinishReason.ERROR}
    assert set(refused) == {"r2", "r3", "r4"}
    for o in refused.values():
        assert o.error_kind == ErrorKind.OVERLOADED
        assert o.error == "engine overloaded: 2 requests waiting (max_waiting_requests=2); retry later"
    assert len(core.scheduler.waiting) == 1  # r0 runs (max_num_seqs=1), r1 waits
    core.add_request(req("r2", prompts[2], greedy(4)))  # room again: admitted
    assert len(core.scheduler.waiting) == 2
    run = run_to_completion(core, [])
    first = [t for o in outs if o.request_id == "r0" for t in o.new_token_ids]  # the step above
    assert run["r0"].finish_reason == FinishReason.LENGTH and first + run["r0"].tokens == reference["r0"].tokens
    for rid in ("r1", "r2"):
        assert run[rid].finish_reason == FinishReason.LENGTH and run[rid].tokens == reference[rid].tokens
    stats = core.scheduler.make_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_an_invalid_request_is_invalid_not_overloaded() -> None:
    """Validation failures are not 'overloaded' (the client must fix them, not retry)."""
    core = make_core(M, max_waiting_requests=5)
    core.add_request(req("bad", [1, 2, 10**6], greedy(4)))
    (out,) = step_outputs(core)
    assert out.finish_reason == FinishReason.ERROR and out.error_kind == ErrorKind.INVALID


def test_unlimited_by_default() -> None:
    core = make_core(M, max_num_seqs=1)
    for i in range(40):
        core.add_request(req(f"r{i}", [5, 6, 7], greedy(1)))
    assert not [o for o in step_outputs(core) if o.finish_reason == FinishReason.ERROR]
    assert core.config.max_waiting_requests is None


def test_llm_raises_engine_overloaded(long_model_dir: str, no_leaked_cores: None) -> None:
    with LLM(model=long_model_dir, model_runner="null", max_waiting_requests=0) as llm:
        with pytest.raises(EngineOverloadedError, match="engine overloaded: 0 requests waiting") as info:
            llm.generate(["a", "b"], SamplingParams(max_tokens=3), use_tqdm=False)
        assert isinstance(info.value, EngineGenerateError)  # code catching the base still works
        op = llm.output_processor
        assert op.request_states == {} and op.parent_requests == {}


async def test_async_llm_overloaded_then_admits_again(long_model_dir: str, no_leaked_cores: None) -> None:
    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=65536, max_num_seqs=1,
                      max_waiting_requests=2)
    try:
        started = asyncio.Event()
        long = asyncio.ensure_future(count_stream_tokens(engine, "long", 60_000, started))
        await asyncio.wait_for(started.wait(), 60)  # running: it holds the only seat
        waiting = [asyncio.ensure_future(count_stream_tokens(engine, f"w{i}", 5)) for i in range(2)]
        await asyncio.sleep(0.2)  # let both reach the core's waiting queue (unordered otherwise)
        with pytest.raises(EngineOverloadedError, match=r"max_waiting_requests=2"):
            await asyncio.wait_for(count_stream_tokens(engine, "over", 5), 60)
        long.cancel()  # the seat frees: the waiting requests run to the end
        assert await asyncio.wait_for(asyncio.gather(*waiting), 60) == [5, 5]
        assert await asyncio.wait_for(count_stream_tokens(engine, "over", 5), 60) == 5  # admitted now
        assert not engine.errored
    finally:
        engine.shutdown()


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str], Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return resp.status, {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def test_server_answers_503_with_retry_after(long_model_dir: str, tidal_cache_dir: str) -> None:
    """max_waiting_requests=0: every request finds the queue full."""
    srv = Server(long_model_dir, ["--model-runner", "null", "--max-model-len", "256", "--max-waiting-requests", "0"],
                 tidal_cache_dir)
    try:
        for stream in (False, True):
            status, headers, body = _post(srv.url + "/v1/completions",
                                          {"prompt": "hi", "max_tokens": 2, "stream": stream})
            assert_openai_error(status, body, 503)
            assert headers.get("retry-after") == "1", headers
            assert "engine overloaded" in body["error"]["message"]
        assert srv.proc.poll() is None
    finally:
        srv.stop()
