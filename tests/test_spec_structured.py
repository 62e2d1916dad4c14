"""Speculative decoding of structured-output requests (issue 33): with the n-gram proposer a
constrained request verifies proposals like any other (each proposal row masked with its
grammar's state after the proposals before it), and its tokens stay exactly those of the same
engine with speculation off (the independent reference: one token a step, one mask a step).

- a batch mixing JSON-schema, regex and choice constrained requests with free ones, greedy and
  seeded temperature 0.8: identical tokens and finish reasons, every constrained output parses
  / matches (its matcher ended where the reference's did), every KV block free at the end;
- the same under a KV pool so small that requests are preempted and recomputed;
- proposals were made and accepted for constrained requests (steps that emitted several tokens
  for one of them, and the spec_decode_* counters), so a refusal would fail the test;
- the core's proposal masks against a fresh matcher fed the tokens one by one (and proposals
  the grammar forbids or ends on), the request's matcher rolled back to where it was;
- the null runner (core/executor.py) reads the proposal rows' masks too.
"""
from __future__ import annotations

import json
import re
from typing import Any, Iterator

import jsonschema
import numpy as np
import pytest

from engine_utils import EOS, VOCAB, assert_all_blocks_free, make_core, model_path, req, run_to_completion
from tidal.core.engine_core import EngineCore
from tidal.protocol import SamplingParams, StructuredOutputsParams
from tidal.protocol.messages import FinishReason
from tidal.protocol.speculative import SpeculativeConfig

SPEC = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4,
                                     "prompt_lookup_min": 2, "prompt_lookup_max": 4})
CORE_KW: dict[str, Any] = dict(max_model_len=512, num_kv_blocks=200, block_size=16, max_num_batched_tokens=128)
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-d]{1,3}$"},
                            "minItems": 2, "maxItems": 10},
                   "n": {"type": "integer", "minimum": 0, "maximum": 999}},
    "required": ["tags", "n"],
}
REGEX = "(ab|cd){2,12}"
CHOICES = ["abcabcabcabcabc", "cdcdcdcd", "xyz"]
WIDTH = (VOCAB + 31) // 32  # bitmask words a row
PROMPTS = {  # text that repeats what the constraint lets through: the n-gram finds it
    "json": 'tags: {"tags":["ab","ab","ab","ab"],"n":1} {"tags":["ab","ab","ab","ab"],"n":1} ',
    "regex": "abababababcdcdcdcdabababab abababab",
    "choice": "abcabcabcabcabc abcabcabcabcabc abcabc",
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """test_spec_decode.py's peaked tiny Qwen3 (init_std 1.0: at temperature 0.8 too its
    outputs repeat themselves, so proposals get accepted), with the "tiny" tokenizer."""
    from tidal.frontend.entrypoints.make_model import make_model

    out = tmp_path_factory.mktemp("spec-structured-model")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", str(out / "cache"))
        return make_model(str(out / "model"), "qwen3", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                          num_kv_heads=2, init_std=1.0, seed=3, tokenizer_dir=model_path("tiny"))


@pytest.fixture(scope="module")
def cores(model: str) -> Iterator[tuple[EngineCore, EngineCore]]:
    off = make_core(model, **CORE_KW)
    on = make_core(model, speculative_config=SPEC, **CORE_KW)
    yield off, on
    off.shutdown()
    on.shutdown()


@pytest.fixture(scope="module")
def encode(model: str) -> Any:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return lambda text: tok.encode(text, add_special_tokens=False), tok


def _params(kind: str, mode: str, i: int, constraint: StructuredOutputsParams | None) -> SamplingParams:
    sampling: dict[str, Any] = dict(temperature=0.0) if mode == "greedy" else dict(temperature=0.8, seed=50 + i)
    if constraint is None:
        return SamplingParams(max_tokens=40, ignore_eos=True, **sampling)
    return SamplingParams(max_tokens=120, structured_outputs=constraint, **sampling)


def _batch(encode: Any, mode: str) -> tuple[list, dict[str, str]]:
    """Constrained requests of each kind (three each) among free ones; rid -> kind."""
    enc, _ = encode
    constraints = {"json": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
                   "regex": StructuredOutputsParams(regex=REGEX),
                   "choice": StructuredOutputsParams(choice=CHOICES)}
    requests: list = []
    kinds: dict[str, str] = {}
    for i in range(3):
        for kind, constraint in constraints.items():
            rid = f"{mode}-{kind}{i}"
            kinds[rid] = kind
            requests.append(req(rid, enc(PROMPTS[kind] + " " * i), _params(kind, mode, i, constraint)))
        free = enc(PROMPTS["regex"] * 2 + "x" * i)
        requests.append(req(f"{mode}-free{i}", free, _params("free", mode, i, None)))
    return requests, kinds


def _check_valid(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    else:
        assert text in CHOICES, text


def _multi_token_steps(result: Any) -> int:
    """Steps that emitted more than one token for the request: accepted proposals."""
    return sum(len(o.new_token_ids) > 1 for o in result.outputs)


@pytest.mark.parametrize("mode", ["greedy", "seeded"])
def test_constrained_requests_speculate_and_keep_their_tokens(cores: tuple[EngineCore, EngineCore], encode: Any,
                                                              mode: str) -> None:
    off_core, on_core = cores
    requests, kinds = _batch(encode, mode)
    off = run_to_completion(off_core, requests)
    assert_all_blocks_free(off_core)
    before = on_core.scheduler.make_stats()
    on = run_to_completion(on_core, requests)
    assert_all_blocks_free(on_core)
    after = on_core.scheduler.make_stats()
    _, tok = encode
    assert set(off.results) == set(on.results)
    for rid, r in off.results.items():
        assert on[rid].error is None and r.error is None, (rid, on[rid].error, r.error)
        assert on[rid].tokens == r.tokens, rid
        assert (on[rid].finish_reason, on[rid].stop_reason) == (r.finish_reason, r.stop_reason), rid
    for rid, kind in kinds.items():
        result = on[rid]
        assert result.finish_reason == FinishReason.STOP, (rid, result.finish_reason)
        _check_valid(kind, tok.decode(result.tokens, skip_special_tokens=True))
    # Constrained requests had proposals accepted (one such request of each kind at least).
    accepted_by_kind = {kind: 0 for kind in PROMPTS}
    for rid, kind in kinds.items():
        accepted_by_kind[kind] += _multi_token_steps(on[rid])
        assert _multi_token_steps(off[rid]) == 0
    assert all(n > 0 for n in accepted_by_kind.values()), accepted_by_kind
    assert after.spec_decode_num_accepted_tokens > before.spec_decode_num_accepted_tokens
    # ... and so they ran in fewer steps than one token a step takes.
    constrained_outputs_on = sum(len(on[rid].outputs) for rid in kinds)
    assert constrained_outputs_on < sum(len(off[rid].outputs) for rid in kinds)


def test_preemption_under_a_tiny_kv_pool(model: str, cores: tuple[EngineCore, EngineCore], encode: Any) -> None:
    """Constrained requests that speculate, preempted and recomputed (their matchers only ever
    hold emitted tokens), keep the reference's tokens; every block is free at the end."""
    off_core, _ = cores
    requests, kinds = _batch(encode, "seeded")
    off = run_to_completion(off_core, requests)
    # 256 tokens of KV for a dozen requests, none shared: preemptions (outputs stay below 256).
    tight = make_core(model, speculative_config=SPEC, **{**CORE_KW, "num_kv_blocks": 16, "max_model_len": 256,
                                                          "enable_prefix_caching": False})
    try:
        on = run_to_completion(tight, requests)
        assert_all_blocks_free(tight)
    finally:
        tight.shutdown()
    assert on.stats.num_preemptions > 0
    for rid, r in off.results.items():
        assert on[rid].error is None, on[rid].error
        assert (on[rid].tokens, on[rid].finish_reason) == (r.tokens, r.finish_reason), rid
    assert sum(_multi_token_steps(on[rid]) for rid in kinds) > 0


def _matcher(model: str, regex: str) -> Any:
    import xgrammar as xgr
    from transformers import AutoTokenizer

    info = xgr.TokenizerInfo.from_huggingface(AutoTokenizer.from_pretrained(model), vocab_size=VOCAB)
    return xgr.GrammarMatcher(xgr.GrammarCompiler(info).compile_regex(regex), override_stop_tokens=[EOS])


def _mask(matcher: Any) -> np.ndarray:
    out = np.zeros((1, WIDTH), dtype=np.int32)
    matcher.fill_next_token_bitmask(out, 0)
    return out[0]


def test_proposal_masks_are_those_of_decoding_and_the_matcher_is_rolled_back(model: str, encode: Any) -> None:
    """fill_proposal_masks' row j is the mask a matcher fed the tokens one by one has after
    proposals 0..j (a fresh matcher is the reference); from a proposal the grammar forbids or
    ends on, every token is allowed; num_valid_proposals cuts before those; the request's
    matcher is left exactly where it was."""
    from tidal.core.structured_output import StructuredOutputRequest

    enc, _ = encode
    regex = "(ab|cd){2,4}"
    history = enc("ab")
    so = StructuredOutputRequest(StructuredOutputsParams(regex=regex), None)  # type: ignore[arg-type]
    so.matcher = _matcher(model, regex)
    for t in history:
        so.accept_token(t)
    before = _mask(so.matcher)
    forbidden = enc("x")[0]
    cases = [  # (proposals, how many the grammar takes without ending on one)
        (enc("cdab"), len(enc("cdab"))),
        (enc("cd") + [forbidden] + enc("ab"), len(enc("cd"))),
        (enc("cdab") + [EOS] + enc("ab"), len(enc("cdab"))),  # EOS ends the grammar
    ]
    for proposals, valid in cases:
        assert so.num_valid_proposals(proposals) == valid, proposals
        rows = np.zeros((1 + len(proposals), WIDTH), dtype=np.int32)
        so.fill_proposal_masks(proposals, rows, 1)
        reference = _matcher(model, regex)
        for t in history:
            assert reference.accept_token(t)
        for j, t in enumerate(proposals):
            if j < valid:
                assert reference.accept_token(t)
                np.testing.assert_array_equal(rows[1 + j], _mask(reference), err_msg=f"{proposals} row {j}")
            else:
                assert (rows[1 + j] == -1).all(), (proposals, j)
        assert not rows[0].any()  # rows before first_row are not touched
        np.testing.assert_array_equal(_mask(so.matcher), before)  # rolled back
        assert not so.is_terminated()
    for t in enc("cd") + [EOS]:  # and it goes on from its own state
        so.accept_token(t)
    assert so.is_terminated()


def test_null_runner_masks_the_proposal_rows(model: str) -> None:
    """The null runner (core/executor.py) samples each proposal row under its own mask (rows
    after the first rows, grammar_proposal_rows' layout): proposals equal to those masked
    tokens are all accepted, and the bonus follows its row's mask too."""
    from tidal.core.executor import NullExecutor
    from tidal.protocol import EngineConfig
    from tidal.protocol.messages import NewRequestData, SchedulerOutput

    executor = NullExecutor(EngineConfig(model=model, model_runner="null", **CORE_KW))
    executor.initialize()
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = [5, 6, 7, 8]
    # Rows: b's first, a's first, then b's two proposal rows, then a's one; each allows one token.
    allowed = [100, 200, 300, 350, 400]
    bits = np.zeros((len(allowed), VOCAB), dtype=bool)
    bits[np.arange(len(allowed)), allowed] = True
    bitmask = np.packbits(bits, axis=1, bitorder="little").view(np.int32)
    so = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(rid, prompt, params, [0], len(prompt) - 1) for rid in ("a", "b")],
        num_scheduled_tokens={"a": 2, "b": 3}, total_num_scheduled_tokens=5,
        structured_output_request_ids=["b", "a"], grammar_bitmask=bitmask,
        scheduled_spec_decode_tokens={"a": [200], "b": [100, 300]})
    out = executor.execute_model(so)
    sampled = dict(zip(out.req_ids, out.sampled_token_ids))
    assert sampled == {"a": [200, 400], "b": [100, 300, 350]}, sampled
