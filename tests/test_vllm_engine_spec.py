"""vLLM's engine API, checked against what vLLM's own tests expect (issue 31):

- `AsyncLLM.pause_generation(mode=...)` / `resume_generation()` / `is_paused()`: vLLM's
  tests/v1/engine/test_async_llm.py pause tests (abort, wait, keep), with exact token counts,
  and for "keep" the tokens of an unpaused run of the same seeded requests as the reference;
- `check_health()` around a lost engine core (vLLM: EngineDeadError once the engine is dead;
  tidal restarts the core, and reports the restart as unhealthy until the new core answers);
- the decoded text of logprob tokens that hold part of a UTF-8 character (vLLM's
  LogprobsProcessor._correct_decoded_token and tests/v1/sample/test_logprobs.py's
  TestCorrectDecodedToken, on mock decoders and on a byte-level tokenizer made here);
- the input errors vLLM's tests match on (tests/entrypoints/llm/test_prompt_validation.py,
  tests/v1/engine/test_llm_engine.py::test_skip_tokenizer_initialization).
"""
from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import warnings
from typing import Any, Callable

import pytest
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tidal.frontend import LLM, AsyncLLM
from tidal.frontend.detokenizer import LogprobsAccumulator, TokenTexts, correct_decoded_token
from tidal.frontend.supervisor import CoreState
from tidal.protocol import EngineRestartingError
from tidal.protocol import EngineDeadError, RequestOutput, RequestOutputKind, SamplingParams

DELTA = RequestOutputKind.DELTA
LONG = 60_000  # null-runner tokens: still running whenever a test acts on it
R = "\ufffd"


async def until(cond: Callable[[], bool], timeout_s: float = 120.0, what: str = "condition") -> None:
    """Wait (bounded) for `cond()`."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def collect(engine: AsyncLLM, rid: str, prompt: Any, params: SamplingParams) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, params, rid)]


def assert_one_finish(outs: list[RequestOutput]) -> None:
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


@pytest.fixture(scope="module")
def null_engine(long_model_dir: str) -> Any:
    llm = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=65536, num_kv_blocks=20_000)
    yield llm
    llm.shutdown()


async def assert_idle(engine: AsyncLLM) -> None:
    """Nothing open here, nothing held by the core."""
    assert engine.get_num_unfinished_requests() == 0 and not engine._running
    stats = await engine.get_stats()
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0


# ------------------------------------------------------------------ pause / resume (vLLM tests)


async def test_pause_resume_basic(null_engine: AsyncLLM) -> None:
    """vLLM's test_pause_resume_basic: the flag, idempotency, every mode with nothing in flight,
    rapid cycles, and the engine serving after them."""
    engine = null_engine
    assert not await engine.is_paused()
    await engine.resume_generation()  # resume when not paused is safe
    assert not await engine.is_paused()
    await engine.pause_generation(mode="abort")
    assert await engine.is_paused()
    await engine.pause_generation(mode="abort")  # pause when paused: no-op
    assert await engine.is_paused()
    await engine.resume_generation()
    assert not await engine.is_paused()
    for mode in ("abort", "wait", "keep"):
        await engine.pause_generation(mode=mode)
        assert await engine.is_paused()
        await engine.resume_generation()
        assert not await engine.is_paused()
    for _ in range(10):
        await engine.pause_generation(mode="abort")
        assert await engine.is_paused()
        await engine.resume_generation()
        assert not await engine.is_paused()
    outs = await collect(engine, "post-cycles", "abc", SamplingParams(max_tokens=5, ignore_eos=True))
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    with pytest.raises(ValueError, match="Invalid pause mode"):
        await engine.pause_generation(mode="freeze")  # type: ignore[arg-type]
    assert not await engine.is_paused()
    await assert_idle(engine)


async def test_pause_abort_ends_streams_and_holds_new_requests(null_engine: AsyncLLM) -> None:
    """vLLM's test_pause_abort (mode="abort", the default): the stream in flight ends with
    finish_reason "abort" by the time pause returns; a new request waits, unsent, until resume."""
    engine = null_engine
    gen = engine.generate("abc", SamplingParams(max_tokens=LONG, ignore_eos=True, output_kind=DELTA), "ab0")
    first = await gen.__anext__()
    await engine.pause_generation(mode="abort")
    assert engine.get_num_unfinished_requests() == 0  # ended before pause returned
    rest = [o async for o in gen]
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert rest[-1].outputs[0].stop_reason is None
    assert sum(len(o.outputs[0].token_ids) for o in [first, *rest]) < LONG
    assert await engine.is_paused()
    blocked = asyncio.create_task(collect(engine, "ab1", "abc", SamplingParams(max_tokens=5, ignore_eos=True)))
    for _ in range(50):
        await asyncio.sleep(0)
    assert not blocked.done() and engine.get_num_unfinished_requests() == 0  # not sent while paused
    await engine.resume_generation()
    outs = await asyncio.wait_for(blocked, 60)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 5
    assert_one_finish(outs)
    await assert_idle(engine)


async def test_pause_wait_lets_inflight_requests_finish(null_engine: AsyncLLM) -> None:
    """vLLM's test_pause_wait: mode="wait" returns once the requests in flight finished, each
    normally (finish_reason "length", all its tokens)."""
    engine = null_engine
    task = asyncio.create_task(collect(engine, "w0", "abc", SamplingParams(max_tokens=300, ignore_eos=True)))
    await until(lambda: engine.get_num_unfinished_requests() == 1, what="the request to be sent")
    await engine.pause_generation(mode="wait", clear_cache=False)
    assert engine.get_num_unfinished_requests() == 0
    outs = await asyncio.wait_for(task, 60)
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 300
    await engine.resume_generation()
    # The deprecated flag (vLLM: a DeprecationWarning, then mode="wait").
    task = asyncio.create_task(collect(engine, "w1", "abc", SamplingParams(max_tokens=200, ignore_eos=True)))
    await until(lambda: engine.get_num_unfinished_requests() == 1, what="the request to be sent")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        await engine.pause_generation(wait_for_inflight_requests=True)
    assert any(issubclass(w.category, DeprecationWarning) for w in caught)
    assert engine.get_num_unfinished_requests() == 0
    outs = await asyncio.wait_for(task, 60)
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 200
    await engine.resume_generation()
    await assert_idle(engine)


# Seeded random sampling on the tiny real model: tokens are a function of (seed, position), so
# the same requests run without a pause are the reference for a paused ("keep") run.
KEEP_MAX_TOKENS = 64


def keep_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=KEEP_MAX_TOKENS, ignore_eos=True, temperature=1.0, seed=500 + i,
                           n=2 if i == 1 else 1, output_kind=DELTA if i % 2 else RequestOutputKind.CUMULATIVE)
            for i in range(3)]


KEEP_PROMPTS = ["The quick brown fox", "def main():", {"prompt_token_ids": [11, 22, 33, 44, 55]}]


class KeepStreams:
    """The keep-pause workload: every completion's tokens, and how many outputs arrived."""

    def __init__(self, engine: AsyncLLM, tag: str) -> None:
        self.engine, self.tag = engine, tag
        self.tokens: dict[tuple[int, int], list[int]] = {}
        self.finishes: dict[tuple[int, int], list[str | None]] = {}
        self.outputs = 0
        self.finished_streams = 0

    async def one(self, i: int, params: SamplingParams) -> None:
        async for out in self.engine.generate(KEEP_PROMPTS[i], params, f"{self.tag}{i}"):
            self.outputs += 1
            for c in out.outputs:
                key = (i, c.index)
                if params.output_kind == DELTA:
                    self.tokens.setdefault(key, []).extend(c.token_ids)
                else:
                    self.tokens[key] = list(c.token_ids)
                self.finishes.setdefault(key, []).append(c.finish_reason)
        self.finished_streams += 1

    def start(self) -> list[asyncio.Task[None]]:
        return [asyncio.create_task(self.one(i, p)) for i, p in enumerate(keep_params())]

    def counts(self) -> dict[tuple[int, int], int]:
        return {k: len(v) for k, v in self.tokens.items()}


def assert_same_as_reference(streams: KeepStreams, reference: KeepStreams) -> None:
    assert streams.tokens == reference.tokens
    assert sorted(streams.tokens) == [(0, 0), (1, 0), (1, 1), (2, 0)]
    for key, tokens in streams.tokens.items():
        assert len(tokens) == KEEP_MAX_TOKENS, key
        assert streams.finishes[key][-1] == "length" and "abort" not in streams.finishes[key]


async def _pause_keep_mid_stream(engine: AsyncLLM, streams: KeepStreams) -> dict[tuple[int, int], int]:
    """Start the workload, pause(keep) once every completion has a token; check nothing runs."""
    await until(lambda: len(streams.tokens) == 4 and all(streams.tokens.values()), what="first tokens")
    await engine.pause_generation(mode="keep")
    assert await engine.is_paused()
    frozen = streams.counts()
    assert all(0 < n < KEEP_MAX_TOKENS for n in frozen.values()), frozen  # frozen mid-stream
    assert streams.finished_streams == 0
    assert engine.output_processor.num_parked() == 4 and not engine.output_processor.has_parking()
    assert engine.get_num_unfinished_requests() == 4  # open, not finished
    stats = await engine.get_stats()  # a round trip through the core: it holds none of them
    assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
    assert streams.counts() == frozen  # and nothing arrived meanwhile
    return frozen


async def test_pause_keep_freezes_requests_and_resumes_them_unchanged(tiny_model_dir: str) -> None:
    """vLLM's test_pause_keep: mode="keep" freezes the requests in flight (n=2 among them) and
    they go on after resume_generation(), each to exactly max_tokens; here, also with exactly
    the tokens of an unpaused run (the core drops them while paused and resumes them from
    their tokens so far, prefix cache cleared: clear_cache's default)."""
    engine = AsyncLLM(model=tiny_model_dir, enable_prefix_caching=True)
    try:
        reference = KeepStreams(engine, "ref")
        await asyncio.wait_for(asyncio.gather(*reference.start()), 240)
        streams = KeepStreams(engine, "keep")
        tasks = streams.start()
        frozen = await _pause_keep_mid_stream(engine, streams)
        await engine.resume_generation()
        await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert not await engine.is_paused()
        assert_same_as_reference(streams, reference)
        assert all(streams.counts()[k] > n for k, n in frozen.items())
        await assert_idle(engine)
    finally:
        engine.shutdown()


async def test_pause_keep_then_abort_or_user_abort_ends_frozen_streams(null_engine: AsyncLLM) -> None:
    """A frozen request ended by abort() while paused, and the rest by pause(mode="abort") (the
    server's shutdown path after a keep-pause): each stream ends once, finish_reason "abort",
    with its tokens so far; nothing is resent on resume and the core holds nothing."""
    engine = null_engine
    params = SamplingParams(max_tokens=LONG, ignore_eos=True, output_kind=DELTA)
    gens = [engine.generate("abc", params, f"ka{i}") for i in range(3)]
    firsts = [await g.__anext__() for g in gens]
    await engine.pause_generation(mode="keep", clear_cache=False)
    assert engine.output_processor.num_parked() == 3
    await engine.abort("ka0")
    rest0 = [o async for o in gens[0]]
    assert rest0[-1].finished and rest0[-1].outputs[0].finish_reason == "abort"
    await engine.pause_generation(mode="abort", clear_cache=False)
    for first, gen in zip(firsts[1:], gens[1:]):
        rest = [o async for o in gen]
        assert_one_finish([first, *rest])
        assert rest[-1].outputs[0].finish_reason == "abort"
    assert engine.output_processor.num_parked() == 0
    await engine.resume_generation()
    await assert_idle(engine)
    assert not engine.output_processor._awaiting_final  # no final output expected of the core


def _kill_core(engine: AsyncLLM) -> None:
    os.kill(engine.engine_core.process.pid, signal.SIGKILL)


async def test_pause_keep_survives_a_core_restart(tiny_model_dir: str) -> None:
    """The core dies while requests are frozen: the new core gets none of them (still paused),
    and resume_generation() sends them back, with the tokens of an unpaused run."""
    engine = AsyncLLM(model=tiny_model_dir, enable_prefix_caching=False)
    try:
        reference = KeepStreams(engine, "ref")
        await asyncio.wait_for(asyncio.gather(*reference.start()), 240)
        streams = KeepStreams(engine, "keepk")
        tasks = streams.start()
        frozen = await _pause_keep_mid_stream(engine, streams)
        supervisor = engine.engine_core.supervisor
        _kill_core(engine)
        await until(lambda: supervisor.num_restarts == 1 and supervisor.live, what="the core restart")
        assert engine.output_processor.num_parked() == 4 and streams.counts() == frozen
        stats = await engine.get_stats()  # the new core holds nothing while paused
        assert stats.num_running_reqs == 0 and stats.num_waiting_reqs == 0
        await engine.resume_generation()
        await asyncio.wait_for(asyncio.gather(*tasks), 240)
        assert_same_as_reference(streams, reference)
        await assert_idle(engine)
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ check_health around core death


async def _health_status(engine: AsyncLLM) -> int:
    """The status tidal's own /health route answers (frontend/entrypoints/openai/api_server.py)."""
    from tidal.frontend.entrypoints.openai.api_server import Routes
    from tidal.frontend.entrypoints.openai.serving_context import ServingContext

    ctx = ServingContext(engine, ["m"], None)
    try:
        return (await Routes(ctx).health(None)).status_code  # type: ignore[arg-type]
    finally:
        ctx.close()


async def test_check_health_reads_errored_as_vllms_test_patches_it(tiny_model_dir: str) -> None:
    """vLLM's tests/v1/engine/test_async_llm.py::test_check_health: healthy, then dead while
    `errored` is patched to True, then healthy again."""
    from unittest.mock import patch

    engine = AsyncLLM(model=tiny_model_dir, max_model_len=128)
    try:
        await engine.check_health()
        with patch.object(type(engine), "errored", new_callable=lambda: property(lambda self: True)):
            with pytest.raises(EngineDeadError):
                await engine.check_health()
        await engine.check_health()
    finally:
        engine.shutdown()


async def _vllm_health_status(engine: AsyncLLM) -> int:
    """vLLM's /health route: 200, or 503 for EngineDeadError."""
    try:
        await engine.check_health()
        return 200
    except EngineDeadError:
        return 503


async def test_check_health_is_unhealthy_while_the_core_restarts(long_model_dir: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Core lost, restarts on (the default): check_health() raises EngineRestartingError (an
    EngineDeadError: /health 503) while the core is LOST (no stream was open: the health check
    itself sets the restart going) and while the replacement starts (held here until the test
    lets it go), then passes again (/health 200) and the engine serves."""
    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=2048)
    client = engine.engine_core
    supervisor = client.supervisor
    starting, release = threading.Event(), threading.Event()
    replace = client.replace_core

    def held_replace() -> object:
        starting.set()
        release.wait(60)
        return replace()

    monkeypatch.setattr(client, "replace_core", held_replace)
    try:
        await engine.check_health()
        assert await _health_status(engine) == 200 and await _vllm_health_status(engine) == 200
        _kill_core(engine)
        await until(lambda: supervisor.state is CoreState.LOST, what="the loss to be noticed")
        assert not starting.is_set()  # nothing had a loop to restart it in
        with pytest.raises(EngineRestartingError, match="being restarted"):
            await engine.check_health()
        await until(starting.is_set, what="the restart to begin")
        assert supervisor.state is CoreState.RECONNECTING
        with pytest.raises(EngineDeadError):
            await engine.check_health()
        assert await _health_status(engine) == 503 and await _vllm_health_status(engine) == 503
        assert engine.is_running and not engine.errored  # not dead: restarting
        release.set()
        await until(lambda: supervisor.live, what="the new core")
        await engine.check_health()
        assert await _health_status(engine) == 200 and await _vllm_health_status(engine) == 200
        outs = await collect(engine, "after", "abc", SamplingParams(max_tokens=3, ignore_eos=True))
        assert len(outs[-1].outputs[0].token_ids) == 3 and supervisor.num_restarts == 1
    finally:
        release.set()
        engine.shutdown()


@pytest.mark.parametrize("max_core_restarts", [0, 1])
async def test_check_health_raises_engine_dead_error_once_no_restart_is_left(long_model_dir: str,
                                                                             max_core_restarts: int) -> None:
    """vLLM's expectation (test_async_llm.py::test_check_health): EngineDeadError once the
    engine is dead -- here with restarts off (max_core_restarts=0) at the first loss, and with
    one restart allowed at the second (the first was restarted: healthy again in between).
    The open stream ends with EngineDeadError too; /health answers 503 from then on."""
    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=65536,
                      max_core_restarts=max_core_restarts)
    supervisor = engine.engine_core.supervisor
    try:
        gen = engine.generate("abc", SamplingParams(max_tokens=LONG, ignore_eos=True, output_kind=DELTA), "d")
        await gen.__anext__()
        for _ in range(max_core_restarts):
            _kill_core(engine)
            await until(lambda: supervisor.num_restarts == 1 and supervisor.live, what="the restart")
            await engine.check_health()
            assert await _health_status(engine) == 200
            await gen.__anext__()  # the stream resumed
        _kill_core(engine)
        await until(lambda: supervisor.state is CoreState.DEAD, what="the engine's death")
        for _ in range(2):  # every later call too
            with pytest.raises(EngineDeadError) as info:
                await engine.check_health()
            assert not isinstance(info.value, EngineRestartingError)
        assert engine.errored and not engine.is_running
        assert await _health_status(engine) == 503 and await _vllm_health_status(engine) == 503
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(60):
                async for _ in gen:
                    pass
    finally:
        engine.shutdown()


async def test_check_health_after_a_request_crashes_the_core_with_restarts_off(tiny_model_dir: str,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/core_crash.py's core (it dies sampling for a prompt holding CRASH_TOKEN) with
    max_core_restarts=0: the stream ends with EngineDeadError, and so does every
    check_health() from then on (a dead engine, not a restarting one); /health answers 503."""
    try:
        from core_crash import use_crashing_core
    except ImportError:  # tests/ made a package
        from tests.core_crash import use_crashing_core  # type: ignore[no-redef]

    crash_token = 7
    use_crashing_core(monkeypatch, crash_token)
    engine = AsyncLLM(model=tiny_model_dir, max_core_restarts=0)
    try:
        ok = await collect(engine, "fine", {"prompt_token_ids": [20, 21, 22]}, SamplingParams(max_tokens=3))
        assert len(ok[-1].outputs[0].token_ids) == 3
        await engine.check_health()
        with pytest.raises(EngineDeadError):
            async with asyncio.timeout(120):
                await collect(engine, "crash", {"prompt_token_ids": [20, crash_token, 22]},
                              SamplingParams(max_tokens=3))
        for _ in range(2):
            with pytest.raises(EngineDeadError) as info:
                await engine.check_health()
            assert not isinstance(info.value, EngineRestartingError)
        assert engine.engine_core.supervisor.num_restarts == 0 and engine.errored
        assert await _health_status(engine) == 503
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ logprob token text (vLLM fix-up)


class MockTokenizer:
    """A tokenizer whose decode is a table (vLLM's TestCorrectDecodedToken mocks decode the
    same way): unlisted sequences decode to `default`. Records the calls."""

    def __init__(self, table: dict[tuple[int, ...], str], default: str = R) -> None:
        self.table, self.default = table, default
        self.calls: list[list[int]] = []

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        self.calls.append(list(ids))
        return self.table.get(tuple(ids), self.default)


def corrected(table: dict[tuple[int, ...], str], token_id: int, context: list[int], default: str = R) -> str:
    """What vLLM's _correct_decoded_token(token_id, context) gives, through tidal's TokenTexts
    (the path every logprob row takes)."""
    return TokenTexts(MockTokenizer(table, default)).in_context(token_id, context)


class TestCorrectDecodedToken:
    """vLLM's TestCorrectDecodedToken cases (newest signature: the token and the sampled tokens
    before it, oldest first; top-k alternatives are never context)."""

    def test_correction_with_context(self) -> None:
        # decode([1, 2]) completes; the clean context token's own text is stripped.
        table = {(2,): R, (1,): "hello ", (1, 2): "hello valid"}
        assert corrected(table, 2, [1]) == "valid"

    def test_correction_with_context_from_logprobs(self) -> None:
        # The previous sampled token (from the logprobs so far, itself byte-fallback: its own
        # decode is U+FFFD, as the mock gives for everything not listed) completes the token.
        assert corrected({(123, 100): ' "polarized"'}, 100, [123]) == ' "polarized"'
        # The same with a clean previous token: its text is not repeated.
        assert corrected({(123,): " ", (123, 100): ' "polarized"'}, 100, [123]) == '"polarized"'

    def test_correction_no_context(self) -> None:
        assert corrected({(100,): R}, 100, []) == ""

    def test_fallback_when_all_attempts_fail(self) -> None:
        tok = MockTokenizer({}, default="still" + R)
        assert TokenTexts(tok).in_context(102, [100, 101]) == ""
        assert [100, 101, 102] in tok.calls and [101, 102] in tok.calls  # tried every context

    def test_increasing_context_window(self) -> None:
        # Only the 3 tokens before complete it (a 4-byte character): their text goes with it.
        table = {(10,): R, (11,): R, (12,): R, (13,): R, (10, 11, 12, 13): "\U0001f600"}
        assert corrected(table, 13, [10, 11, 12]) == "\U0001f600"

    def test_context_is_at_most_four_tokens(self) -> None:
        # A completion that would need 5 context tokens is not found: "".
        table = {(i,): R for i in range(6)} | {(0, 1, 2, 3, 4, 5): "x"}
        assert corrected(table, 5, [0, 1, 2, 3, 4]) == ""
        table = {(i,): R for i in range(5)} | {(1, 2, 3, 4): "y", (0,): "a"}
        assert corrected(table, 4, [0, 1, 2, 3]) == "y"

    def test_clean_prefix_of_several_tokens(self) -> None:
        table = {(3,): R, (1,): " the", (2,): " term", (1, 2): " the term", (2, 3): " term" + R,
                 (1, 2, 3): " the term\u201c"}
        assert corrected(table, 3, [1, 2]) == "\u201c"

    def test_byte_fallback_context_text_goes_with_the_completing_token(self) -> None:
        # Token 44 is byte-fallback (its own text ends in U+FFFD): the clean context is [1385].
        # decode([1385, 44, 48]) = " term \u201c", decode([1385]) = " term": " \u201c" (the
        # space from token 44, which itself shows "").
        table = {(48,): R, (44,): " " + R, (1385,): " term", (44, 48): " \u201c" + R,
                 (1385, 44, 48): " term \u201c"}
        assert corrected(table, 48, [1385, 44]) == " \u201c"
        assert corrected(table, 44, [1385]) == ""  # it only begins the character

    def test_prefix_mismatch_uses_the_common_prefix(self) -> None:
        # A normalizing decoder: the context's own text is not a prefix of the joint decode.
        table = {(9,): R, (8,): "Hello  ", (8, 9): "Hello \u00e9"}
        assert corrected(table, 9, [8]) == "\u00e9"

    def test_tokens_not_ending_in_replacement_char_are_kept(self) -> None:
        tok = MockTokenizer({(5,): "fine", (6,): R + "x"})
        texts = TokenTexts(tok)
        assert texts.in_context(5, [1, 2]) == "fine" and texts.in_context(6, [1]) == R + "x"
        assert tok.calls == [[5], [6]]  # no correction attempted

    def test_function_matches_the_method(self) -> None:
        table = {(48,): R, (44,): " " + R, (1385,): " term", (1385, 44, 48): " term \u201c"}
        tok = MockTokenizer(table)
        assert correct_decoded_token(lambda ids: tok.decode(ids), 48, [1385, 44]) == " \u201c"


class TestLogprobsProcessorPath:
    """vLLM's test class drives `LogprobsProcessor._correct_decoded_token` with a Mock
    tokenizer: the same cases through tidal's class at vLLM's module path."""

    @staticmethod
    def processor(table: dict[tuple[int, ...], str], default: str = R) -> Any:
        from unittest.mock import Mock

        from tidal.v1.engine.logprobs import LogprobsProcessor

        tokenizer = Mock()
        tokenizer.decode.side_effect = lambda ids: table.get(tuple(ids), default)
        return LogprobsProcessor(tokenizer=tokenizer, logprobs=[], prompt_logprobs=None, cumulative_logprob=0.0,
                                 num_logprobs=1, num_prompt_logprobs=None)

    def test_correction_with_context(self) -> None:
        p = self.processor({(1,): "hello ", (1, 2): "hello valid"})
        assert p._correct_decoded_token(2, [1]) == "valid"

    def test_no_context_and_all_attempts_failing_give_empty(self) -> None:
        assert self.processor({})._correct_decoded_token(100, []) == ""
        p = self.processor({}, default="still" + R)
        assert p._correct_decoded_token(102, [100, 101]) == ""
        p.tokenizer.decode.assert_any_call([100, 101, 102])

    def test_byte_fallback_context_text_goes_with_the_completing_token(self) -> None:
        table = {(44,): " " + R, (1385,): " term", (44, 48): " \u201c" + R, (1385, 44, 48): " term \u201c"}
        assert self.processor(table)._correct_decoded_token(48, [1385, 44]) == " \u201c"


def _byte_symbol(b: int) -> str:
    """The GPT-2 byte-to-unicode symbol of byte `b` (what ByteLevel tokens are spelt in)."""
    return bytes_to_unicode()[b]


def _spell(data: bytes) -> str:
    return "".join(_byte_symbol(b) for b in data)


@pytest.fixture(scope="module")
def byte_tokenizer() -> tuple[Any, dict[str, int]]:
    """A byte-level BPE tokenizer (the `tokenizers` library, made here) whose vocabulary holds
    every byte plus pieces that split characters: b" \\xe2" (a space and the first byte of a
    curly quote), b"\\x80\\x9c" / b"\\x80\\x9d" (the rest of \u201c / \u201d), " term", "X"."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    pieces = {"term": b" term", "sp_e2": b" \xe2", "q_open": b"\x80\x9c", "q_close": b"\x80\x9d"}
    vocab = {_byte_symbol(b): b for b in range(256)}
    vocab.update({_spell(data): 256 + i for i, data in enumerate(pieces.values())})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False)
    ids = {name: 256 + i for i, name in enumerate(pieces)}
    ids.update({"X": ord("X"), "e4": 0xE4, "b8": 0xB8, "ad": 0xAD, "x": ord("x")})
    return fast, ids


def _rows(tokenizer: Any, rows: list[list[int]], prompt: list[int] = (), logprobs: int = 2,
          flat: bool = False) -> list[dict[int, Any]]:
    """Sample logprob rows ([chosen, top-1..]) through LogprobsAccumulator; their Logprob dicts."""
    import numpy as np

    from tidal.protocol.messages import EngineCoreOutput, LogprobsArrays

    acc = LogprobsAccumulator(SamplingParams(logprobs=logprobs, flat_logprobs=flat),
                              TokenTexts(tokenizer), list(prompt))
    for row in rows:
        arrays = LogprobsArrays(np.array([row], dtype=np.int32), np.full((1, len(row)), -1.0, dtype=np.float32),
                                np.array([1], dtype=np.int32))
        acc.add(EngineCoreOutput("r", [row[0]], new_logprobs=arrays))
    sample, _ = acc.sample()
    return [sample[i] for i in range(len(sample))]


@pytest.mark.parametrize("flat", [False, True])
def test_logprob_tokens_of_split_characters_on_a_byte_level_tokenizer(byte_tokenizer: tuple[Any, dict[str, int]],
                                                                      flat: bool) -> None:
    """vLLM's worked cases on real byte-level decoding: "\u4e2d" as 3 byte tokens shows "", "",
    "\u4e2d"; a clean token before it stays its own; a piece holding a space and a quote's first
    byte shows "" and the quote's last piece " \u201c" (vLLM gives the space to the token that
    completes the character); top-k alternatives at that position are each completed with the
    sampled tokens before them (never with each other): " \u201d" for the other quote. The
    chosen tokens' texts join to the tokenizer's decode of the sequence."""
    tok, t = byte_tokenizer
    seq = [t["X"], t["e4"], t["b8"], t["ad"], t["term"], t["sp_e2"], t["q_open"]]
    alts = {t["q_open"]: [t["q_close"], t["x"]]}
    rows = _rows(tok, [[s, *alts.get(s, [t["x"], t["e4"]])] for s in seq], flat=flat)
    chosen = [row[s].decoded_token for row, s in zip(rows, seq)]
    assert chosen == ["X", "", "", "\u4e2d", " term", "", " \u201c"]
    assert "".join(chosen) == tok.decode(seq) == "X\u4e2d term \u201c"
    last = rows[-1]
    assert last[t["q_close"]].decoded_token == " \u201d" and last[t["x"]].decoded_token == "x"
    # Alternatives that only begin a character show "" (the lone byte e4 after "X").
    assert rows[0][t["e4"]].decoded_token == ""
    assert not any(lp.decoded_token.endswith(R) for row in rows for lp in row.values())


def test_logprob_context_reaches_into_the_prompt(byte_tokenizer: tuple[Any, dict[str, int]]) -> None:
    """The first sampled token's context is the prompt's end (tidal; vLLM starts from the sampled
    tokens alone and would show "" here, losing the character): a character begun by the
    prompt's last bytes is shown whole by the token that completes it."""
    tok, t = byte_tokenizer
    rows = _rows(tok, [[t["ad"], t["x"]], [t["x"], t["e4"]]], prompt=[t["X"], t["e4"], t["b8"]])
    assert [rows[0][t["ad"]].decoded_token, rows[1][t["x"]].decoded_token] == ["\u4e2d", "x"]


# ------------------------------------------------------------------ input errors in vLLM's words


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> Any:
    with LLM(tiny_model_dir, model_runner="null", multiprocessing=False, max_model_len=64) as engine:
        yield engine


def test_empty_prompt(llm: LLM) -> None:
    """vLLM's tests/entrypoints/llm/test_prompt_validation.py::test_empty_prompt."""
    with pytest.raises(ValueError, match="decoder prompt cannot be empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(ValueError, match="^The decoder prompt cannot be empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)


def test_out_of_vocab_token(llm: LLM) -> None:
    """vLLM's test_out_of_vocab_token ("out of vocabulary"), in its InputProcessor's words."""
    for bad in (999999, -1):
        with pytest.raises(ValueError, match=f"^Token id {bad} is out of vocabulary"):
            llm.generate({"prompt_token_ids": [1, bad]}, use_tqdm=False)


def test_prompt_longer_than_max_model_len(llm: LLM) -> None:
    """vLLM's InputProcessor._validate_prompt_len sentences (tidal's detail follows them)."""
    with pytest.raises(ValueError, match=r"^The decoder prompt \(length 65\) is longer than the maximum model "
                                         r"length of 64\. .*prompt length 65 exceeds max_model_len 64"):
        llm.generate({"prompt_token_ids": [1] * 65}, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^The decoder prompt \(length 64\) plus the number of requested output "
                                         r"tokens \(at least 1\) is longer than the maximum model length of 64"):
        llm.generate({"prompt_token_ids": [1] * 64}, use_tqdm=False)
    (ok,) = llm.generate({"prompt_token_ids": [1] * 63}, SamplingParams(max_tokens=5), use_tqdm=False)
    assert len(ok.outputs[0].token_ids) == 1 and ok.outputs[0].finish_reason == "length"


def test_skip_tokenizer_initialization(tiny_model_dir: str) -> None:
    """vLLM's tests/v1/engine/test_llm_engine.py::test_skip_tokenizer_initialization: a text
    prompt is refused in vLLM's words (newest match "`skip_tokenizer_init=True`", older
    "cannot pass text prompts when"); token ids run, with no text."""
    with LLM(tiny_model_dir, model_runner="null", multiprocessing=False, skip_tokenizer_init=True) as engine:
        params = SamplingParams(prompt_logprobs=True, detokenize=True, max_tokens=4)
        with pytest.raises(ValueError, match="`skip_tokenizer_init=True`"):
            engine.generate("abc", params, use_tqdm=False)
        with pytest.raises(ValueError, match="cannot pass text prompts when"):
            engine.generate("abc", params, use_tqdm=False)
        outputs = engine.generate({"prompt_token_ids": [1, 2, 3]}, sampling_params=params, use_tqdm=False)
    assert len(outputs) == 1
    completions = outputs[0].outputs
    assert completions[0].text == "" and len(completions[0].token_ids) == 4
