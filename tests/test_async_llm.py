"""AsyncLLM end to end with a real engine-core process (vLLM's tests/v1/engine/test_async_llm.py
style): load, cancellation, abort, text consistency, stop strings, core death.

The null model runner (one token per request per step, no torch) is used wherever the model
does not matter; the tiny real model where text does.
"""
from __future__ import annotations

import asyncio
import logging
import os
import random
import signal
import time
from typing import Any, AsyncGenerator

import pytest

from tidal.frontend import AsyncLLM
from tidal.protocol import EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams

try:
    from conftest import core_children, ipc_dir_of
except ImportError:  # tests/ made a package
    from tests.conftest import core_children, ipc_dir_of  # type: ignore[no-redef]

DELTA, FINAL, CUM = RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY, RequestOutputKind.CUMULATIVE
LONG = 60_000  # tokens: still running when a test acts on it (it never waits for the end)


@pytest.fixture(scope="module")
def engine(long_model_dir: str) -> Any:
    # Used by several tests, each in its own event loop: AsyncLLM follows the running loop.
    llm = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=65536, num_kv_blocks=80_000,
                   max_num_seqs=256, max_num_batched_tokens=4096)
    yield llm
    llm.shutdown()


async def collect(engine: AsyncLLM, rid: str, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]


def assert_one_finish(outs: list[RequestOutput]) -> None:
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


async def wait_idle(engine: AsyncLLM, timeout_s: float = 5.0) -> Any:
    """Core stats once nothing runs and every KV block is free again."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await engine.get_stats()
        idle = stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        if idle and stats.num_free_blocks == stats.num_total_blocks or time.monotonic() > deadline:
            return stats


async def assert_clean(engine: AsyncLLM) -> None:
    assert engine.get_num_unfinished_requests() == 0
    assert not engine.output_processor.parent_requests and not engine._running
    stats = await wait_idle(engine)
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert stats.num_free_blocks == stats.num_total_blocks


async def test_load_100_concurrent(engine: AsyncLLM) -> None:
    rng = random.Random(0)
    specs = []
    for i in range(100):
        n = 3 if i % 10 == 0 else 1
        specs.append((f"load-{i}", rng.randint(1, 120), rng.choice([DELTA, FINAL, CUM]), n))

    async def run(rid: str, max_tokens: int, kind: RequestOutputKind, n: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=kind, n=n)
        outs = await collect(engine, rid, "Hello there", params)
        assert_one_finish(outs)
        assert all(o.request_id == rid for o in outs)
        if kind == FINAL:
            assert len(outs) == 1
        per_index = [0] * n
        for o in outs:
            for c in o.outputs:
                if kind == DELTA:
                    per_index[c.index] += len(c.token_ids)
                else:
                    per_index[c.index] = len(c.token_ids)
        assert per_index == [max_tokens] * n, (rid, kind, per_index)
        assert sum(per_index) == n * max_tokens
        assert all(c.finish_reason == "length" for c in outs[-1].outputs) or n > 1

    await asyncio.gather(*(run(*s) for s in specs))
    await assert_clean(engine)


async def test_cancel_some_tasks(engine: AsyncLLM) -> None:
    started = {i: asyncio.Event() for i in range(20)}

    async def run(i: int, max_tokens: int) -> int:
        n = 0
        async for out in engine.generate("abc", SamplingParams(
                max_tokens=max_tokens, ignore_eos=True, output_kind=DELTA), f"cancel-{i}"):
            n += len(out.outputs[0].token_ids)
            started[i].set()
        return n

    lengths = [LONG if i % 2 == 0 else 50 + i for i in range(20)]
    tasks = [asyncio.create_task(run(i, lengths[i])) for i in range(20)]
    await asyncio.gather(*(started[i].wait() for i in range(0, 20, 2)))
    for i in range(0, 20, 2):
        tasks[i].cancel()
    for i, task in enumerate(tasks):
        if i % 2 == 0:
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            assert await task == lengths[i]
    # A cancelled id is reusable at once and gets its full output.
    outs = await collect(engine, "cancel-0", "abc", SamplingParams(max_tokens=77, ignore_eos=True, output_kind=DELTA))
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 77
    await assert_clean(engine)


async def test_break_out_of_async_for(engine: AsyncLLM) -> None:
    params = SamplingParams(max_tokens=LONG, ignore_eos=True, output_kind=DELTA)
    gen: AsyncGenerator[RequestOutput, None] = engine.generate("abc", params, "brk")
    seen = 0
    async for _ in gen:
        seen += 1
        if seen == 3:
            break
    await gen.aclose()  # what the loop's async-generator finalizer does once `gen` is dropped
    assert engine.get_num_unfinished_requests() == 0
    outs = await collect(engine, "brk", "abc", SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(outs[-1].outputs[0].token_ids) == 40
    await assert_clean(engine)


async def test_break_without_aclose_aborts(engine: AsyncLLM) -> None:
    async def consume_some() -> None:
        async for out in engine.generate("abc", SamplingParams(max_tokens=LONG, ignore_eos=True), "drop"):
            if len(out.outputs[0].token_ids) >= 2:
                break  # the generator is dropped here; the loop's finalizer closes it

    await consume_some()
    for _ in range(100):
        if engine.get_num_unfinished_requests() == 0:
            break
        await asyncio.sleep(0.01)
    await assert_clean(engine)


@pytest.mark.parametrize("kind", [DELTA, CUM])
async def test_abort_ends_streams_normally(engine: AsyncLLM, kind: RequestOutputKind) -> None:
    ids = [f"abort-{kind.name}-{i}" for i in range(6)]
    first = {rid: asyncio.Event() for rid in ids}

    lengths = {rid: LONG if i < 4 else 300 for i, rid in enumerate(ids)}

    async def run(rid: str) -> list[RequestOutput]:
        outs = []
        params = SamplingParams(max_tokens=lengths[rid], ignore_eos=True, output_kind=kind)
        async for out in engine.generate("abc", params, rid):
            outs.append(out)
            first[rid].set()
        return outs

    tasks = [asyncio.create_task(run(rid)) for rid in ids]
    await asyncio.gather(*(e.wait() for e in first.values()))
    await engine.abort(ids[:4])
    await engine.abort("not-a-running-request")  # ignored
    results = await asyncio.gather(*tasks)
    for rid, outs in zip(ids, results, strict=True):
        assert_one_finish(outs)
        last = outs[-1].outputs[0]
        n = sum(len(o.outputs[0].token_ids) for o in outs) if kind == DELTA else len(last.token_ids)
        if rid in ids[:4]:
            assert last.finish_reason == "abort" and 0 < n < LONG
        else:
            assert last.finish_reason == "length" and n == 300
    await assert_clean(engine)


async def test_running_id_is_rejected_and_bad_input_raises_first(engine: AsyncLLM) -> None:
    gen = engine.generate("abc", SamplingParams(max_tokens=LONG, ignore_eos=True), "dup")
    await gen.__anext__()
    with pytest.raises(ValueError, match="already running"):
        await collect(engine, "dup", "abc", SamplingParams(max_tokens=4))
    await gen.aclose()
    for prompt, params in [("", SamplingParams()), ({"prompt_token_ids": [10**6]}, SamplingParams()),
                           ("abc", SamplingParams(logprobs=1000)), (123, SamplingParams())]:
        with pytest.raises(ValueError):
            await collect(engine, "bad", prompt, params)
    with pytest.raises(TypeError):
        AsyncLLM(model="x", no_such_engine_arg=1)
    await assert_clean(engine)


def test_uvloop_and_default_loop_in_turn(engine: AsyncLLM) -> None:
    """One engine, driven from uvloop and then from the default loop (the handler follows)."""
    import uvloop

    async def run(tag: str) -> int:
        outs = await asyncio.gather(*(collect(engine, f"{tag}-{i}", "abc", SamplingParams(
            max_tokens=30, ignore_eos=True, output_kind=DELTA)) for i in range(8)))
        return sum(len(o.outputs[0].token_ids) for stream in outs for o in stream)

    assert uvloop.run(run("uv")) == 240
    assert asyncio.run(run("aio")) == 240
    assert uvloop.run(run("uv2")) == 240


# ------------------------------------------------------------------ real model: text


@pytest.fixture(scope="module")
def real_engine(tiny_model_dir: str) -> Any:
    llm = AsyncLLM(model=tiny_model_dir, num_kv_blocks=256, max_model_len=512)
    yield llm
    llm.shutdown()


PROMPTS = ["Hello 😀 world 🦊🎉", "日本語のテキスト、中文文本。", "def f(x):\n    return x  # ünïcödé"]


async def test_text_consistency_byte_level(real_engine: AsyncLLM) -> None:
    tok = await real_engine.get_tokenizer()
    for i, prompt in enumerate(PROMPTS):
        params = dict(max_tokens=48, temperature=1.0, seed=100 + i, ignore_eos=True)
        delta = await collect(real_engine, f"d{i}", prompt, SamplingParams(**params, output_kind=DELTA))
        final = await collect(real_engine, f"f{i}", prompt, SamplingParams(**params, output_kind=FINAL))
        delta_text = "".join(o.outputs[0].text for o in delta)
        ids = [t for o in delta for t in o.outputs[0].token_ids]
        assert len(final) == 1 and final[0].outputs[0].token_ids == ids  # seeded: same tokens
        assert delta_text == final[0].outputs[0].text == tok.decode(ids, skip_special_tokens=True)
        assert delta[0].prompt == prompt


async def test_stop_string_never_streamed(real_engine: AsyncLLM) -> None:
    base = dict(max_tokens=64, temperature=1.0, seed=7, ignore_eos=True)
    full = (await collect(real_engine, "s0", PROMPTS[0], SamplingParams(**base, output_kind=FINAL)))[0]
    text = full.outputs[0].text
    assert len(text) > 20
    stop = text[len(text) // 2: len(text) // 2 + 2]
    cut = text.index(stop)
    outs = await collect(real_engine, "s1", PROMPTS[0], SamplingParams(**base, stop=[stop], output_kind=DELTA))
    streamed = "".join(o.outputs[0].text for o in outs)
    assert stop not in streamed and streamed == text[:cut]
    assert outs[-1].outputs[0].finish_reason == "stop" and outs[-1].outputs[0].stop_reason == stop
    assert_one_finish(outs)
    assert real_engine.get_num_unfinished_requests() == 0
    stats = await wait_idle(real_engine)
    assert stats.num_running_reqs == 0  # the front-end aborted it in the core


# ------------------------------------------------------------------------- death


async def test_sigkill_core_fails_every_stream(long_model_dir: str) -> None:
    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=65536, max_num_seqs=8,
                      max_core_restarts=0)  # no restart: the dead core is final
    pid = engine.engine_core.process.pid
    ipc_dir = ipc_dir_of(engine.engine_core.address)
    assert os.path.isdir(ipc_dir)
    running = [asyncio.Event() for _ in range(4)]

    async def stream(i: int) -> None:
        async for _ in engine.generate("abc", SamplingParams(max_tokens=60000, ignore_eos=True, output_kind=DELTA), f"k{i}"):
            running[i].set()

    tasks = [asyncio.create_task(stream(i)) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in running)), 30)
    os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    for task in tasks:
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(task, 5)
    assert time.monotonic() - t0 < 5
    assert engine.errored
    with pytest.raises(EngineDeadError):  # and every later call, at once
        await collect(engine, "later", "abc", SamplingParams(max_tokens=2))
    with pytest.raises(EngineDeadError):
        await engine.abort("k0")
    engine.shutdown()
    assert not [p for p in core_children() if p.pid == pid]
    assert not os.path.exists(ipc_dir)


def test_dropped_engine_stops_its_core(long_model_dir: str) -> None:
    """No shutdown() call: garbage collection of the engine stops the core and removes its dir."""
    import gc

    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=2048)
    pid, ipc_dir = engine.engine_core.process.pid, ipc_dir_of(engine.engine_core.address)

    async def one() -> None:
        await collect(engine, "x", "abc", SamplingParams(max_tokens=3))

    asyncio.run(one())
    del engine
    gc.collect()
    assert pid not in {p.pid for p in core_children()}
    assert not os.path.exists(ipc_dir)


async def test_stream_interval_reaches_the_output_processor(long_model_dir: str) -> None:
    """The stream_interval engine arg paces the front-end's outputs (tests/test_output_processor.py
    has the pacing itself: here an instant null runner lets a lagging consumer's DELTA chunks
    merge, so chunk sizes are not fixed); the stream still delivers every token once."""
    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=2048, stream_interval=4)
    try:
        assert engine.output_processor.stream_interval == 4
        params = SamplingParams(max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        outs = [o async for o in engine.generate("abc", params, "si")]
        assert sum(len(o.outputs[0].token_ids) for o in outs) == 10 and outs[-1].finished
    finally:
        engine.shutdown()


# ------------------------------------------- vLLM's AsyncLLM surface (issue 10)


async def _first_output(gen: AsyncGenerator[RequestOutput, None]) -> RequestOutput:
    return await gen.__anext__()


async def test_pause_without_waiting_aborts_and_holds_new_requests(engine: AsyncLLM) -> None:
    gen = engine.generate("abc", SamplingParams(max_tokens=LONG, ignore_eos=True, output_kind=DELTA), "p0")
    await _first_output(gen)
    assert not await engine.is_paused()
    await engine.pause_generation()
    assert await engine.is_paused()
    rest = [o async for o in gen]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    held = asyncio.create_task(collect(engine, "p1", "abc", SamplingParams(max_tokens=5, ignore_eos=True)))
    for _ in range(20):  # the task runs up to its wait for resume, and no further
        await asyncio.sleep(0)
    assert not held.done() and engine.get_num_unfinished_requests() == 0
    await engine.resume_generation()
    outs = await held
    assert not await engine.is_paused() and len(outs[-1].outputs[0].token_ids) == 5
    await assert_clean(engine)


async def test_pause_waiting_lets_inflight_requests_finish(engine: AsyncLLM) -> None:
    task = asyncio.create_task(collect(engine, "w0", "abc", SamplingParams(max_tokens=300, ignore_eos=True)))
    while engine.get_num_unfinished_requests() == 0:
        await asyncio.sleep(0)
    with pytest.warns(DeprecationWarning, match="wait_for_inflight_requests"):  # vLLM's old spelling of mode="wait"
        await engine.pause_generation(wait_for_inflight_requests=True, clear_cache=False)
    assert engine.get_num_unfinished_requests() == 0
    outs = await task
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 300
    await engine.resume_generation()
    await assert_clean(engine)


async def _gated_tokenization(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> tuple[asyncio.Event, asyncio.Event]:
    """Hold every request inside its (off-loop) tokenization until `release` is set."""
    entered, release = asyncio.Event(), asyncio.Event()
    original = engine.input_processor.process_async

    async def gated(*args: Any, **kwargs: Any) -> Any:
        entered.set()
        await release.wait()
        return await original(*args, **kwargs)

    monkeypatch.setattr(engine.input_processor, "process_async", gated)
    return entered, release


async def test_abort_during_tokenization_sends_nothing(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = await _gated_tokenization(engine, monkeypatch)
    task = asyncio.create_task(collect(engine, "tk", "abc", SamplingParams(max_tokens=LONG, ignore_eos=True, n=2)))
    await asyncio.wait_for(entered.wait(), 10)
    await engine.abort("tk")
    release.set()
    outs = await asyncio.wait_for(task, 30)
    assert len(outs) == 1 and outs[0].finished and outs[0].request_id == "tk"
    assert [(c.finish_reason, c.token_ids) for c in outs[0].outputs] == [("abort", [])] * 2
    await assert_clean(engine)


async def test_pause_during_tokenization_holds_the_request(engine: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    entered, release = await _gated_tokenization(engine, monkeypatch)
    task = asyncio.create_task(collect(engine, "tp", "abc", SamplingParams(max_tokens=4, ignore_eos=True)))
    await asyncio.wait_for(entered.wait(), 10)
    await engine.pause_generation(mode="wait", clear_cache=False)
    release.set()
    for _ in range(20):  # tokenized now, it waits for resume instead of running while paused
        await asyncio.sleep(0)
    assert not task.done() and engine.get_num_unfinished_requests() == 0
    await engine.resume_generation()
    outs = await asyncio.wait_for(task, 30)
    assert len(outs[-1].outputs[0].token_ids) == 4
    await assert_clean(engine)


async def test_request_options_and_abort_internal(engine: AsyncLLM) -> None:
    for kwargs, match in [(dict(priority=1), "Priority scheduling is not enabled"),
                          (dict(lora_request=object()), "LoRA"), (dict(data_parallel_rank=1), "data_parallel_rank")]:
        with pytest.raises(ValueError, match=match):
            await collect_kw(engine, "opt", kwargs)
    outs = await collect_kw(engine, "opt", dict(priority=0, data_parallel_rank=0, lora_request=None,
                                                 prompt_text="abc", trace_headers={}, tokenization_kwargs={}))
    assert outs[-1].finished
    gen = engine.generate("abc", SamplingParams(max_tokens=LONG, ignore_eos=True), "ai")
    await _first_output(gen)
    await engine.abort(engine._running["ai"], internal=True)
    assert [o async for o in gen][-1].outputs[0].finish_reason == "abort"
    await engine.check_health()
    assert engine.is_running and not engine.is_stopped and not engine.errored
    await assert_clean(engine)


async def collect_kw(engine: AsyncLLM, rid: str, kwargs: dict[str, Any]) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    return [out async for out in engine.generate("abc", params, rid, **kwargs)]


class _Recorder:
    """A vLLM-style stat logger (StatLoggerBase's record/log) that keeps what it was given."""

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        self.vllm_config, self.engine_index = vllm_config, engine_index
        self.records: list[Any] = []
        self.logs = 0

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        self.records.append(scheduler_stats)

    def log(self) -> None:
        self.logs += 1


async def test_from_engine_args_stats_and_loggers(long_model_dir: str, caplog: pytest.LogCaptureFixture) -> None:
    from tidal.frontend import AsyncEngineArgs

    loggers: list[_Recorder] = []

    def factory(vllm_config: Any, engine_index: int) -> _Recorder:
        loggers.append(_Recorder(vllm_config, engine_index))
        return loggers[-1]

    args = AsyncEngineArgs(model=long_model_dir, model_runner="null", max_model_len=2048, enable_log_requests=True)
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[factory])
    try:
        assert loggers[0].vllm_config.model_config.max_model_len == 2048 and loggers[0].engine_index == 0
        with caplog.at_level(logging.INFO, logger="tidal"):
            outs = await collect(engine, "s0", "abc", SamplingParams(max_tokens=6, ignore_eos=True))
            await engine.do_log_stats()
        assert outs[-1].metrics is not None  # stats on: vLLM's EngineArgs default
        assert loggers[0].records and loggers[0].logs == 1
        assert max(s.num_generation_tokens for s in loggers[0].records) >= 6
        messages = [r.getMessage() for r in caplog.records]
        assert "Added request s0." in messages
        assert any("Avg generation throughput" in m and "Running: 0 reqs" in m for m in messages)
        served = {m.name: m for m in engine.metrics.get_metrics() if not m.labels.get("finished_reason")}
        assert served["vllm:generation_tokens"].value == 6
        assert (await engine.get_model_config()).max_model_len == 2048
        assert (await engine.get_tokenizer()) is engine.tokenizer
    finally:
        engine.shutdown()
    with pytest.raises(EngineDeadError):
        await engine.check_health()
    config = AsyncEngineArgs(model=long_model_dir, model_runner="null", max_model_len=1024).create_engine_config()
    engine = AsyncLLM.from_vllm_config(config, disable_log_stats=True)
    try:
        outs = await collect(engine, "v0", "abc", SamplingParams(max_tokens=4, ignore_eos=True))
        assert outs[-1].metrics is None and engine.vllm_config.model_config.max_model_len == 1024
    finally:
        engine.shutdown()


class _Broken(_Recorder):
    """A user's stat logger with a bug: every call raises, after counting itself."""

    def record(self, scheduler_stats: Any, iteration_stats: Any, mm_cache_stats: Any = None,
               engine_idx: int = 0) -> None:
        self.records.append(scheduler_stats)
        raise RuntimeError("bug in a user's record()")

    def log(self) -> None:
        self.logs += 1
        raise RuntimeError("bug in a user's log()")


async def test_a_failing_user_stat_logger_never_ends_the_streams(long_model_dir: str,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Its calls run in the output handler: a raise there used to mark the engine dead. Now each
    call is lost alone, its first failure logged, and the built-in metrics still count."""
    from tidal.frontend import AsyncEngineArgs

    broken: list[_Broken] = []
    args = AsyncEngineArgs(model=long_model_dir, model_runner="null", max_model_len=1024)
    engine = AsyncLLM.from_engine_args(args, stat_loggers=[lambda cfg, i: broken.append(_Broken(cfg, i)) or broken[-1]])
    try:
        with caplog.at_level(logging.ERROR, logger="tidal.frontend.metrics"):
            for i in range(3):
                outs = await collect(engine, f"b{i}", "abc", SamplingParams(max_tokens=5, ignore_eos=True))
                assert len(outs[-1].outputs[0].token_ids) == 5 and outs[-1].finished
            await engine.do_log_stats()
        await engine.check_health()
        assert len(broken[0].records) >= 3 and broken[0].logs == 1  # still called after failing
        failures = [r for r in caplog.records if "stat logger _Broken failed" in r.getMessage()]
        assert len(failures) == 1 and failures[0].exc_info is not None  # the first only, with its traceback
        served = {m.name: m for m in engine.metrics.get_metrics() if not m.labels.get("finished_reason")}
        assert served["vllm:generation_tokens"].value == 15
    finally:
        engine.shutdown()


async def test_a_request_too_big_for_the_core_is_refused_before_sending(long_model_dir: str) -> None:
    """Past MAX_MESSAGE_BYTES encoded (here a 65 MiB stop string), libzmq would drop the
    front-end's connection, which read as a lost core: a restart for every stream, twice, and
    the request given up. Now a ValueError names the limit, and the core never sees it."""
    from tidal.frontend import AsyncEngineArgs
    from tidal.utils.zmq_utils import MAX_MESSAGE_BYTES

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=long_model_dir, model_runner="null", max_model_len=1024))
    try:
        bystander = engine.generate("abc", SamplingParams(max_tokens=900, ignore_eos=True), "by")
        await _first_output(bystander)
        with pytest.raises(ValueError, match=f"more than the {MAX_MESSAGE_BYTES} bytes"):
            await collect(engine, "big", "abc", SamplingParams(max_tokens=3, stop=["x" * (65 << 20)]))
        outs = [o async for o in bystander]
        assert len(outs[-1].outputs[0].token_ids) == 900 and outs[-1].finished
        assert engine.engine_core.supervisor.num_restarts == 0
        outs = await collect(engine, "next", "abc", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(outs[-1].outputs[0].token_ids) == 3 and engine.get_num_unfinished_requests() == 0
    finally:
        engine.shutdown()


def test_failure_late_in_start_up_stops_the_core(long_model_dir: str) -> None:
    """A stat logger factory that raises (the last step of start-up): the core it started is gone."""
    from tidal.frontend import AsyncEngineArgs

    def broken_factory(vllm_config: Any, engine_index: int) -> Any:
        raise RuntimeError("broken stat logger")

    before = {p.pid for p in core_children()}
    args = AsyncEngineArgs(model=long_model_dir, model_runner="null", max_model_len=2048)
    with pytest.raises(RuntimeError, match="broken stat logger"):
        AsyncLLM.from_engine_args(args, stat_loggers=[broken_factory])
    assert {p.pid for p in core_children()} <= before
