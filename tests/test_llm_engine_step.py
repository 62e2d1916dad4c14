"""vLLM's LLMEngine step API (`LLMEngine.from_engine_args`, `llm.llm_engine.add_request/step/
has_unfinished_requests/abort_request`): the loop of vLLM's llm_engine_example runs as
written, its greedy tokens are transformers', every output kind streams as it should, and
step-API requests share the engine with generate() without losing an output."""
from __future__ import annotations

import random

import pytest

from engine_utils import assert_greedy_equal, hf_generate, model_path, robust_prompt
from tidal import EngineArgs, LLM, LLMEngine, RequestOutputKind, SamplingParams
from tidal.engine.llm_engine import LLMEngine as ShimLLMEngine


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    eng = LLMEngine.from_engine_args(EngineArgs(model=model_path("tiny"), max_num_seqs=4, seed=0))
    yield eng
    eng.shutdown()


def test_vllm_example_loop_gives_transformers_greedy_tokens(engine: LLMEngine) -> None:
    assert ShimLLMEngine is LLMEngine
    rng = random.Random(3)
    prompts = [robust_prompt("tiny", rng, 6 + i, 8) for i in range(5)]  # 5 > max_num_seqs: some wait
    pending = [(str(i), {"prompt_token_ids": p}) for i, p in enumerate(prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    finished: dict[str, list[int]] = {}
    steps = 0
    while pending or engine.has_unfinished_requests():  # vLLM's llm_engine_example.py, verbatim
        if pending:
            rid, prompt = pending.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = list(out.outputs[0].token_ids)
        steps += 1
        assert steps < 500
    assert engine.get_num_unfinished_requests() == 0
    for i, p in enumerate(prompts):
        assert_greedy_equal(finished[str(i)], hf_generate("tiny", p, 8), f"request {i}")


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_output_kinds(engine: LLMEngine, kind: RequestOutputKind) -> None:
    engine.add_request(f"k{kind.name}", {"prompt_token_ids": [5, 6, 7]},
                       SamplingParams(max_tokens=6, ignore_eos=True, output_kind=kind))
    seen: list[list[int]] = []
    while engine.has_unfinished_requests():
        seen += [list(o.outputs[0].token_ids) for o in engine.step() if o.request_id == f"k{kind.name}"]
    if kind == RequestOutputKind.FINAL_ONLY:
        assert [len(s) for s in seen] == [6]
    elif kind == RequestOutputKind.DELTA:
        assert sum(len(s) for s in seen) == 6 and all(s for s in seen)
    else:  # CUMULATIVE: each output extends the last
        assert seen[-1][:len(seen[0])] == seen[0] and len(seen[-1]) == 6
        assert all(len(a) < len(b) for a, b in zip(seen, seen[1:]))


def test_abort_and_refusals(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    engine.add_request("a", "hello", params)
    engine.add_request("b#1", "hello", params.clone(n=2))  # '#' in an id is the caller's business
    with pytest.raises(ValueError, match="already running"):
        engine.add_request("a", "again", params)
    with pytest.raises(ValueError, match="non-empty str"):
        engine.add_request("", "x", params)
    with pytest.raises(ValueError, match="out of vocabulary"):
        engine.add_request("c", {"prompt_token_ids": [1, 10**6]}, params)
    assert engine.get_num_unfinished_requests() == 2  # the refused ones left nothing behind
    engine.step()
    engine.abort_request(["a", "unknown"])
    ids = set()
    while engine.has_unfinished_requests():
        ids |= {o.request_id for o in engine.step()}
    assert "a" not in ids and "b#1" in ids


def test_generate_beside_step_requests_loses_nothing() -> None:
    with LLM(model_path("tiny"), max_num_seqs=4, seed=0) as llm:
        engine = llm.llm_engine
        assert isinstance(engine, LLMEngine) and llm.llm_engine is engine
        engine.add_request("s", {"prompt_token_ids": [9, 8, 7]},
                           SamplingParams(max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
        outs = llm.generate(["a b", "c"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3]
        got = 0
        while engine.has_unfinished_requests():
            for o in engine.step():
                assert o.request_id == "s"
                got += len(o.outputs[0].token_ids)
        assert got == 40  # the deltas that came during generate() were kept for step()


def test_a_failed_request_is_raised_by_step_and_the_others_go_on(engine: LLMEngine) -> None:
    from tidal import StructuredOutputsParams
    from tidal.protocol.errors import EngineGenerateError

    engine.add_request("good", {"prompt_token_ids": [3, 4]}, SamplingParams(max_tokens=20, ignore_eos=True))
    # The core compiles grammars: an invalid regex fails this request there, and only it.
    engine.add_request("bad", {"prompt_token_ids": [3, 4]}, SamplingParams(
        max_tokens=5, structured_outputs=StructuredOutputsParams(regex="a(b")))
    errors, final = [], None
    while engine.has_unfinished_requests():
        try:
            outs = engine.step()
        except EngineGenerateError as e:
            errors.append(e)
            continue
        final = next((o for o in outs if o.request_id == "good" and o.finished), final)
    assert [getattr(e, "request_id", None) for e in errors] == ["bad"]
    assert final is not None and len(final.outputs[0].token_ids) == 20
