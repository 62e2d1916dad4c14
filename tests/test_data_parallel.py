"""Data parallelism on one host (data_parallel_size=2): two engine cores behind one front-end.

The reference is the same requests on one core (DP=1): sampling is a pure function of (seed,
position), so whichever core a request runs on -- and after a SIGKILL of its core, whichever
replaces it -- its tokens must be exactly those. Per-engine metrics (vLLM's `engine` label)
show which core served what.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import pytest

from tidal.frontend import LLM, AsyncLLM
from tidal.protocol import SamplingParams

try:
    from test_core_restart import Streams, mixed_params, no_orphans, prompt_of  # noqa: F401 (a fixture)
except ImportError:  # tests/ made a package
    from tests.test_core_restart import Streams, mixed_params, no_orphans, prompt_of  # type: ignore[no-redef]  # noqa: F401

MAX_TOKENS = 24


def generation_tokens(engine: Any) -> dict[str, float]:
    """vllm:generation_tokens per `engine` label."""
    return {m.labels["engine"]: m.value for m in engine.metrics.get_metrics() if m.name == "vllm:generation_tokens"}


async def wait_until(condition: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: str) -> dict[str, dict[int, list[int]]]:
    """64 concurrent streams, greedy and seeded mixed (n=2 among them), on one core."""
    async def run() -> dict[str, dict[int, list[int]]]:
        engine = AsyncLLM(model=tiny_model_dir, max_num_seqs=128)
        try:
            streams = Streams(engine)
            await streams.run(mixed_params(64, MAX_TOKENS))
            return streams.tokens
        finally:
            engine.shutdown()
    return asyncio.run(run())


async def test_dp2_streams_equal_dp1_and_both_engines_serve(tiny_model_dir: str, reference: Any,
                                                            no_orphans: None) -> None:
    engine = AsyncLLM(model=tiny_model_dir, max_num_seqs=128, data_parallel_size=2, disable_log_stats=False)
    try:
        client = engine.engine_core
        assert len(client.clients) == 2
        assert {c.process.pid for c in client.clients} and client.clients[0].process.pid != client.clients[1].process.pid
        streams = Streams(engine)
        await streams.run(mixed_params(64, MAX_TOKENS))
        assert streams.tokens == reference
        per_engine = generation_tokens(engine)
        total = sum(len(toks) for got in reference.values() for toks in got.values())
        assert set(per_engine) == {"0", "1"} and sum(per_engine.values()) == total
        assert min(per_engine.values()) >= total / 4, per_engine  # the router spread them

        # data_parallel_rank pins: 6 requests of MAX_TOKENS each, all on engine 1.
        before = generation_tokens(engine)
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0.0)
        for i in range(6):
            async for _ in engine.generate(prompt_of(i), params, f"pin{i}", data_parallel_rank=1):
                pass
        after = generation_tokens(engine)
        assert after["1"] - before["1"] == 6 * MAX_TOKENS and after["0"] == before["0"]
        with pytest.raises(ValueError, match=r"data_parallel_rank 2 is out of range \[0, 2\)"):
            async for _ in engine.generate(prompt_of(0), params, "bad", data_parallel_rank=2):
                pass

        # An abort reaches the engine that holds the request: it stops running there.
        long = SamplingParams(max_tokens=1500, ignore_eos=True)
        for rank in (0, 1):
            outputs = 0
            async for _ in engine.generate(prompt_of(9), long, f"long{rank}", data_parallel_rank=rank):
                outputs += 1
                if outputs == 3:
                    await engine.abort(f"long{rank}")
            member = client.clients[rank]
            stats = await member.call_utility_async("get_stats")
            deadline = time.monotonic() + 10
            while stats.num_running_reqs + stats.num_waiting_reqs and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                stats = await member.call_utility_async("get_stats")
            assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        assert engine.get_num_unfinished_requests() == 0
        merged = await engine.get_stats()
        assert merged.num_total_blocks == sum([(await c.call_utility_async("get_stats")).num_total_blocks
                                               for c in client.clients])
    finally:
        engine.shutdown()


async def test_sigkill_of_one_engine_every_stream_completes_exactly(tiny_model_dir: str, reference: Any,
                                                                   no_orphans: None) -> None:
    engine = AsyncLLM(model=tiny_model_dir, max_num_seqs=128, data_parallel_size=2, enable_prefix_caching=False)
    try:
        client = engine.engine_core
        victim, survivor = client.clients[1], client.clients[0]
        streams = Streams(engine)

        async def kill_engine_1() -> None:
            await wait_until(lambda: len(streams.arrivals) >= 40)
            os.kill(victim.process.pid, signal.SIGKILL)
            await wait_until(lambda: victim.supervisor.num_restarts == 1 and victim.supervisor.live, 60)

        await asyncio.wait_for(streams.run(mixed_params(64, MAX_TOKENS), kill_engine_1()), 120)
        assert streams.tokens == reference
        assert victim.supervisor.num_restarts == 1 and survivor.supervisor.num_restarts == 0
        assert engine.get_num_unfinished_requests() == 0
        stats = await engine.get_stats()
        assert stats.num_running_reqs == stats.num_waiting_reqs == 0
        assert stats.num_free_blocks == stats.num_total_blocks  # nothing leaked on either core
    finally:
        engine.shutdown()


def test_llm_dp2_equals_dp1_with_logprobs(tiny_model_dir: str, no_orphans: None) -> None:
    prompts = [prompt_of(i) for i in range(12)]
    params = [SamplingParams(max_tokens=16, ignore_eos=True, temperature=i % 2, seed=i, logprobs=2, n=1 + i % 2)
              for i in range(12)]
    results = []
    for dp in (1, 2):
        llm = LLM(model=tiny_model_dir, data_parallel_size=dp)
        try:
            results.append(llm.generate(prompts, params, use_tqdm=False))
            if dp == 2:
                assert llm.get_stats().num_total_blocks == sum(
                    c.call_utility("get_stats").num_total_blocks for c in llm.llm_engine.engine_core.clients)
        finally:
            llm.shutdown()
    for ref, got in zip(*results):
        for a, b in zip(ref.outputs, got.outputs):
            assert a.token_ids == b.token_ids and a.text == b.text
            assert [list(lp) for lp in a.logprobs] == [list(lp) for lp in b.logprobs]


def test_dp_refusals(tiny_model_dir: str) -> None:
    from tidal.frontend.engine_args import EngineArgs
    from tidal.frontend.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="needs multiprocessing"):
        LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir, data_parallel_size=2), enable_multiprocessing=False)
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        LLM(model=tiny_model_dir, data_parallel_size=0)


async def test_dp2_on_ray_equals_dp1_and_survives_sigkill(tiny_model_dir: str, reference: Any,
                                                          no_orphans: None) -> None:
    """data_parallel_backend="ray": the engines placed by a private local Ray cluster; the
    same tokens as DP=1, both serve, and a SIGKILLed engine is restarted by its actor on its
    address while every stream completes exactly."""
    pytest.importorskip("ray")
    engine = AsyncLLM(model=tiny_model_dir, max_num_seqs=128, data_parallel_size=2, data_parallel_backend="ray",
                      disable_log_stats=False)
    try:
        client = engine.engine_core
        assert all(c.address.startswith("tcp://") for c in client.clients)
        streams = Streams(engine)
        pid = client._ray.core_pids()[1]

        async def kill_engine_1() -> None:
            await wait_until(lambda: len(streams.arrivals) >= 40)
            os.kill(pid, signal.SIGKILL)

        await asyncio.wait_for(streams.run(mixed_params(64, MAX_TOKENS), kill_engine_1()), 180)
        assert streams.tokens == reference
        per_engine = generation_tokens(engine)
        assert set(per_engine) == {"0", "1"} and min(per_engine.values()) > 0
        assert [s.num_restarts for s in client.supervisors] == [0, 1]
    finally:
        engine.shutdown()
