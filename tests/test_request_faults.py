"""Requests that must fail in the front-end, alone and cleanly (issue 12's probes): every bad
value is a ValueError before anything is sent, a request that fails while it is registered or
sent leaves no state behind, and two LLMs on one headless core never collide on request ids."""
from __future__ import annotations

import asyncio
import subprocess
import threading
from typing import Any, Iterator

import msgspec
import numpy as np
import pytest

from tidal.frontend import LLM, AsyncLLM
from tidal.frontend.output_processor import OutputProcessor
from tidal.protocol import RequestOutputKind, SamplingParams
from tidal.protocol.codec import MsgpackDecoder, MsgpackEncoder
from tidal.protocol.messages import EngineCoreRequest
from tidal.protocol.request_rules import RequestLimits, check_request
from tidal.protocol.sampling_params import INT64_MAX

try:
    from test_core_proc import headless_core  # noqa: F401 - a fixture, used by name
except ImportError:  # tests/ made a package
    from tests.test_core_proc import headless_core  # type: ignore[no-redef]  # noqa: F401

NAN, INF = float("nan"), float("inf")
LIMITS = RequestLimits(max_model_len=64, vocab_size=100, max_logprobs=5)


# ------------------------------------------------------------------ wrong error types
@pytest.mark.parametrize("kwargs", [
    dict(seed=2**70), dict(seed=-2**70), dict(seed=1.5), dict(seed="1"),
    dict(seed=2**64 - 1, n=2),  # child 1 would be seeded past 64 bits
    dict(stop="\ud800"), dict(stop=["ok", "\udfff"]), dict(bad_words=["\ud800"]),
    dict(stop=[1]), dict(stop=b"x"), dict(bad_words="word"), dict(bad_words=[None]),
    dict(max_tokens=5.0), dict(max_tokens="5"), dict(max_tokens=2**64),
    dict(top_k=2.5), dict(top_k=2**63), dict(n=2.0), dict(n=2**70), dict(min_tokens=1.5),
    dict(logprobs=2.0), dict(prompt_logprobs=2**64), dict(truncate_prompt_tokens=2.0),
    dict(truncate_prompt_tokens=True),
    dict(temperature="1"), dict(temperature=None), dict(top_p="0.5"), dict(min_p=[0.1]),
    *[{name: value} for name in ("presence_penalty", "frequency_penalty", "repetition_penalty",
                                 "temperature", "top_p", "min_p") for value in (NAN, INF, -INF)],
    dict(ignore_eos="yes"), dict(detokenize=1), dict(skip_special_tokens=None),
    dict(spaces_between_special_tokens=0), dict(include_stop_str_in_output="no"), dict(flat_logprobs=1),
    dict(stop_token_ids=[2**70]), dict(stop_token_ids=[1.0]), dict(stop_token_ids=[True]), dict(stop_token_ids=5),
    dict(allowed_token_ids=[2**64]), dict(allowed_token_ids=["1"]), dict(allowed_token_ids=[False]),
    dict(logit_bias={2**70: 1.0}), dict(logit_bias={1: "x"}), dict(logit_bias={1: 10**400}), dict(logit_bias=[1]),
    dict(output_kind=5), dict(output_kind="delta"), dict(extra_args=["x"]), dict(temperature=10**400),
], ids=lambda kwargs: repr(kwargs)[:48])
def test_bad_values_are_value_errors(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_n_is_bounded_by_tidal_max_n_sequences(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's VLLM_MAX_N_SEQUENCES (default 16384): n = 2**31 stalled the whole server."""
    assert SamplingParams(n=16384).n == 16384
    with pytest.raises(ValueError, match=r"n must be at most 16384 \(TIDAL_MAX_N_SEQUENCES\), got 2147483648"):
        SamplingParams(n=2**31)
    monkeypatch.setenv("TIDAL_MAX_N_SEQUENCES", "3")
    assert SamplingParams(n=3).n == 3
    with pytest.raises(ValueError, match="at most 3"):
        SamplingParams(n=4)
    monkeypatch.setenv("TIDAL_MAX_N_SEQUENCES", "many")
    with pytest.raises(ValueError, match="TIDAL_MAX_N_SEQUENCES must be a positive integer, got 'many'"):
        SamplingParams(n=1)


def test_accepted_values_travel_as_the_wire_types() -> None:
    p = SamplingParams(n=np.int64(2), seed=np.int32(7), max_tokens=np.int64(5), top_k=np.int16(3),
                       temperature=np.float32(0.5), top_p=1, presence_penalty=np.float64(0.5),
                       stop_token_ids=(np.int64(3), 4), allowed_token_ids=[np.int64(1)],
                       logit_bias={"5": np.float32(2.0)}, output_kind=1, stop=("a", "b"), logprobs=True)
    assert (type(p.n), type(p.seed), type(p.max_tokens), type(p.top_k)) == (int, int, int, int)
    assert (type(p.temperature), type(p.top_p), type(p.presence_penalty)) == (float, float, float)
    assert p.stop_token_ids == [3, 4] and all(type(t) is int for t in p.stop_token_ids)
    assert p.allowed_token_ids == [1] and type(p.allowed_token_ids[0]) is int
    assert p.logit_bias == {5: 2.0} and p.output_kind is RequestOutputKind.DELTA
    assert p.stop == ["a", "b"] and p.logprobs == 1
    assert SamplingParams(seed=INT64_MAX - 1, n=2).seed == INT64_MAX - 1  # child 1: INT64_MAX
    req = EngineCoreRequest("r", [1, 2], p)
    (back,) = [MsgpackDecoder(EngineCoreRequest).decode(MsgpackEncoder().encode(req))]
    assert back.sampling_params == p


def test_seed_minus_one_means_none() -> None:
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(seed=-2).seed == -2  # any other int is a seed, as in vLLM


def test_params_changed_after_construction_fail_in_the_input_processor(tiny_input_processor: Any) -> None:
    for change in (dict(max_tokens=5.0), dict(stop=[1]), dict(seed=2**70), dict(stop=["\ud800"])):
        params = SamplingParams(n=2)
        for name, value in change.items():
            setattr(params, name, value)  # structs are mutable: no __post_init__ ran
        with pytest.raises(ValueError):
            tiny_input_processor.process("r", {"prompt_token_ids": [1, 2]}, params)


def test_drawn_seeds_leave_room_for_the_children(tiny_input_processor: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 1 << 40
    monkeypatch.setenv("TIDAL_MAX_N_SEQUENCES", str(n))  # far past the default, for the seed arithmetic
    for _ in range(20):
        req, _ = tiny_input_processor.process("r", {"prompt_token_ids": [1]}, SamplingParams(n=n))
        assert 0 <= req.sampling_params.seed <= INT64_MAX - (n - 1)


# ------------------------------------------------------------------ one rule text, both sides
def test_priority_rule_is_check_requests() -> None:
    params = SamplingParams()
    assert check_request([1], params, LIMITS, priority=3) == "Got priority 3 but Priority scheduling is not enabled."
    priority_limits = RequestLimits(64, 100, 5, scheduling_policy="priority")
    assert check_request([1], params, priority_limits, priority=-3) is None
    for bad in (1.5, True, 2**70):
        assert "priority must" in check_request([1], params, priority_limits, priority=bad)  # type: ignore[arg-type,operator]


def test_extra_args_never_reach_the_core() -> None:
    params = SamplingParams(extra_args={"plugin": [1, {"x": 2}]})
    assert check_request([1], params, LIMITS) == "extra_args must not be sent to the engine core"
    # Nor can they arrive: the core's decoder takes null in their place (no untyped value).
    frames = MsgpackEncoder().encode(EngineCoreRequest("r", [1], params))
    with pytest.raises(msgspec.ValidationError):
        MsgpackDecoder(EngineCoreRequest).decode(frames)


# ------------------------------------------------------------------ no state left behind
@pytest.fixture
def tiny_input_processor() -> Any:
    from tidal.frontend.input_processor import InputProcessor

    return InputProcessor(None, max_model_len=64, vocab_size=100, max_logprobs=5)


def _fail_second_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Building the second (child) request state raises, as a broken detokenizer would."""
    from tidal.frontend import request_state as op_module  # where RequestState builds its detokenizer

    real, calls = op_module.IncrementalDetokenizer.from_request, [0]

    def from_request(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise TypeError("broken detokenizer")
        return real(*args, **kwargs)

    monkeypatch.setattr(op_module.IncrementalDetokenizer, "from_request", staticmethod(from_request))


def test_output_processor_add_request_is_all_or_nothing(tiny_input_processor: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    op = OutputProcessor(None)
    req, _ = tiny_input_processor.process("p", {"prompt_token_ids": [1, 2]},
                                          SamplingParams(n=2, detokenize=False))
    _fail_second_state(monkeypatch)
    with pytest.raises(TypeError, match="broken detokenizer"):
        op.add_request(req, None)
    assert op.request_states == {} and op.parent_requests == {}


@pytest.fixture(scope="module")
def llm(long_model_dir: str) -> Iterator[LLM]:
    with LLM(model=long_model_dir, model_runner="null", max_model_len=256, multiprocessing=False) as engine:
        yield engine


def _assert_clean(engine: LLM | AsyncLLM) -> None:
    op = engine.output_processor
    assert op.request_states == {} and op.parent_requests == {}


def _fail_second_send(engine: LLM | AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second child's send raises, after the first reached the core."""
    real, calls = engine.engine_core.add_request, [0]

    def add_request(req: EngineCoreRequest) -> Any:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("send failed")
        return real(req)

    monkeypatch.setattr(engine.engine_core, "add_request", add_request)


def test_llm_rejected_request_leaves_no_state(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = SamplingParams(n=2, max_tokens=4)
    bad.stop = [1]  # type: ignore[list-item]  # the probe: a non-string stop, after construction
    with pytest.raises(ValueError, match="stop must be"):
        llm.generate(["fine", "bad"], [SamplingParams(n=2), bad], use_tqdm=False)
    _assert_clean(llm)
    with monkeypatch.context() as m:
        _fail_second_state(m)
        with pytest.raises(TypeError, match="broken detokenizer"):
            llm.generate("x", SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    _assert_clean(llm)
    with monkeypatch.context() as m:
        _fail_second_send(llm, m)
        with pytest.raises(RuntimeError, match="send failed"):
            llm.generate("x", SamplingParams(n=2, max_tokens=4), use_tqdm=False)
    _assert_clean(llm)
    stats = llm.get_stats()  # the child that reached the core was aborted there
    assert stats.num_running_reqs + stats.num_waiting_reqs == 0
    out = llm.generate("x", SamplingParams(n=2, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [3, 3]


async def _outputs(engine: AsyncLLM, params: SamplingParams, request_id: str) -> list[Any]:
    async def drain() -> list[Any]:
        return [out async for out in engine.generate("x", params, request_id)]

    return await asyncio.wait_for(drain(), 60)


async def test_async_llm_rejected_request_leaves_no_state(long_model_dir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    engine = AsyncLLM(model=long_model_dir, model_runner="null", max_model_len=256)
    try:
        bad = SamplingParams(n=2)
        bad.stop = [1]  # type: ignore[list-item]
        with pytest.raises(ValueError, match="stop must be"):
            await _outputs(engine, bad, "r1")
        _assert_clean(engine)
        with monkeypatch.context() as m:
            _fail_second_state(m)
            with pytest.raises(TypeError, match="broken detokenizer"):
                await _outputs(engine, SamplingParams(n=2, max_tokens=4), "r2")
        _assert_clean(engine)
        with monkeypatch.context() as m:
            _fail_second_send(engine, m)
            with pytest.raises(RuntimeError, match="send failed"):
                await _outputs(engine, SamplingParams(n=2, max_tokens=4), "r2")
        _assert_clean(engine)
        stats = await asyncio.wait_for(engine.get_stats(), 30)
        assert stats.num_running_reqs + stats.num_waiting_reqs == 0
        outs = await _outputs(engine, SamplingParams(n=2, max_tokens=3, ignore_eos=True,
                                                     output_kind=RequestOutputKind.FINAL_ONLY), "r2")
        assert [len(c.token_ids) for c in outs[-1].outputs] == [3, 3]
    finally:
        engine.shutdown()


# ------------------------------------------------------------------ ids across front-ends
def test_two_llms_share_a_headless_core(headless_core: tuple[str, subprocess.Popen], long_model_dir: str,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    address = headless_core[0]  # test_core_proc's core (it reaps it); 16 seqs: both batches at once
    llms = [LLM(model=long_model_dir, core_address=address, engine_start_timeout_s=60) for _ in range(2)]
    try:
        sent: list[set[str]] = [set(), set()]
        for engine, ids in zip(llms, sent):
            def add_request(req: EngineCoreRequest, real: Any = engine.engine_core.add_request,
                            ids: set[str] = ids) -> Any:
                ids.add(req.request_id)
                return real(req)

            monkeypatch.setattr(engine.engine_core, "add_request", add_request)
        results: dict[int, Any] = {}
        ready = threading.Barrier(2, timeout=30)

        def run(i: int) -> None:
            ready.wait()  # both batches in flight together, with the same visible ids
            try:
                results[i] = llms[i].generate([f"p{k}" for k in range(8)],
                                              SamplingParams(max_tokens=200, ignore_eos=True), use_tqdm=False)
            except Exception as e:
                results[i] = e

        threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads), "a batch never finished"
        for i in range(2):
            outs = results[i]
            assert not isinstance(outs, Exception), outs
            assert [o.request_id for o in outs] == [str(k) for k in range(8)]  # vLLM's visible ids
            assert all(len(o.outputs[0].token_ids) == 200 for o in outs)
        # Apart in the front-ends already, whatever the core keys requests by.
        assert len(sent[0]) == len(sent[1]) == 8 and not sent[0] & sent[1]
    finally:
        for engine in llms:
            engine.shutdown()


def test_llm_priority_errors_are_the_cores_words(llm: LLM) -> None:
    with pytest.raises(ValueError) as info:
        llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False, priority=[3])
    assert str(info.value) == "Got priority 3 but Priority scheduling is not enabled."
    for bad in (2**70, 1.5):
        with pytest.raises(ValueError, match="priority must"):
            llm.generate("x", SamplingParams(max_tokens=2), use_tqdm=False, priority=[bad])  # type: ignore[list-item]
    _assert_clean(llm)


def test_params_broken_after_construction_never_reach_the_front_ends_changes(tiny_input_processor: Any) -> None:
    params = SamplingParams()
    params.n = 2.0  # type: ignore[assignment]  # the seed drawn for n children must not see it
    with pytest.raises(ValueError, match="n must be an integer"):
        tiny_input_processor.process("r", {"prompt_token_ids": [1]}, params)
    params = SamplingParams(bad_words=["x"])
    params.bad_words = [None]  # type: ignore[list-item]
    with pytest.raises(ValueError, match="bad_words must be"):
        tiny_input_processor.process("r", {"prompt_token_ids": [1]}, params)
