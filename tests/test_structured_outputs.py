"""Structured outputs (xgrammar): every constrained output of a random-weight model sampled at
temperature 1 parses and validates (jsonschema, re.fullmatch, a set of choices, a Python-AST
check of the arithmetic grammar), unconstrained neighbours are untouched, preemption keeps
outputs valid and identical, a bad spec fails its request alone, and the server takes
response_format / structured_outputs."""
from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.engine_utils import EOS, make_core, req, run_to_completion
from tests.test_structured_whitespace import FORM_PROPERTIES, whitespace_runs
from tidal.frontend import LLM
from tidal.protocol import EngineGenerateError, SamplingParams, StructuredOutputsParams
from tidal.protocol.messages import FinishReason

# Strings are bounded by patterns, not maxLength: xgrammar 0.2.9 lets a maxLength string hold
# raw control characters (U+0000-U+001F), which JSON forbids (strict json.loads refuses them).
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        **FORM_PROPERTIES,
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{0,6}$"},
                           "zip": {"type": "integer", "minimum": 10000, "maximum": 99999}},
            "required": ["city", "zip"],
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "address"],
}
DATE = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
EMAIL = r"[a-z]{1,8}(\.[a-z]{1,5})?@[a-z]{2,8}\.(com|org|net)"
CHOICES = ["alpha", "beta gamma", "délta", '{"k": 1}', "42"]
ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= num | "(" inner ")"
inner ::= num (("+" | "-" | "*") num){1,2}
num ::= [1-9] [0-9]{0,2}
"""
N = 50
PROMPT = "Fill in the form:"


def _sp(seed: int, max_tokens: int = 200, **constraint: Any) -> SamplingParams:
    so = StructuredOutputsParams(**constraint) if constraint else None
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=so)


def _is_arithmetic(text: str) -> bool:
    """An independent check of ARITHMETIC's language: Python parses it as +-*/ of positive
    integers without leading zeros (and nothing else), with no space anywhere."""
    if " " in text or re.search(r"(?<![0-9])0", text):
        return False
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        return False
    ops = (ast.Add, ast.Sub, ast.Mult, ast.Div)
    for node in ast.walk(tree.body):
        if isinstance(node, ast.BinOp):
            if not isinstance(node.op, ops):
                return False
        elif isinstance(node, ast.Constant):
            if type(node.value) is not int or not 1 <= node.value <= 999:
                return False
        elif not isinstance(node, ast.operator):
            return False
    return True


@pytest.fixture(scope="module")
def llm(tiny_model_dir: str) -> Iterator[LLM]:
    with LLM(model=tiny_model_dir, max_model_len=1024) as engine:
        yield engine


def test_every_kind_valid_in_a_mixed_batch(llm: LLM) -> None:
    kinds: list[tuple[str, SamplingParams]] = []
    kinds += [("json", _sp(i, json=SCHEMA, disable_any_whitespace=True)) for i in range(N)]
    kinds += [("date" if i % 2 else "email", _sp(i, regex=DATE if i % 2 else EMAIL)) for i in range(N)]
    kinds += [("choice", _sp(i, choice=CHOICES)) for i in range(N)]
    kinds += [("grammar", _sp(i, grammar=ARITHMETIC)) for i in range(N)]
    free = [_sp(1000 + i, max_tokens=24) for i in range(12)]
    # Unconstrained requests spread through the batch.
    batch = [p for _, p in kinds]
    for i, p in enumerate(free):
        batch.insert(i * 17, p)
    outs = llm.generate([PROMPT] * len(batch), batch, use_tqdm=False)
    by_params = {id(p): o.outputs[0] for p, o in zip(batch, outs)}
    seen: dict[str, set[str]] = {}
    for kind, p in kinds:
        out = by_params[id(p)]
        text = out.text
        assert out.finish_reason == "stop", (kind, text, out.finish_reason)
        seen.setdefault(kind, set()).add(text)
        if kind == "json":
            jsonschema.validate(json.loads(text), SCHEMA)
        elif kind == "date":
            assert re.fullmatch(DATE, text), text
        elif kind == "email":
            assert re.fullmatch(EMAIL, text), text
        elif kind == "choice":
            assert text in CHOICES, text
        else:
            assert _is_arithmetic(text), text
    # Temperature 1 explores: the constraint shapes the outputs, it does not pin them.
    assert len(seen["json"]) > 10 and len(seen["grammar"]) > 10 and len(seen["choice"]) >= 3
    # Rows without a constraint sample exactly what they sample alone.
    alone = llm.generate([PROMPT] * len(free), free, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in alone] == [by_params[id(p)].token_ids for p in free]


def _closing_bias(tokenizer: Any) -> dict[int, float]:
    """logit_bias toward the tokens that close JSON strings, arrays and objects: any JSON is
    what json_object allows, and a random model left alone rarely closes a string."""
    return {tokenizer.convert_tokens_to_ids(c): 6.0 for c in ('"', "}", "]")}


def test_json_object_n_and_logprobs_of_the_masked_distribution(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    outs = llm.generate(PROMPT, SamplingParams(
        n=3, seed=7, max_tokens=400, logit_bias=_closing_bias(tokenizer), structured_outputs=(
            StructuredOutputsParams(json_object=True, disable_any_whitespace=True))), use_tqdm=False)
    assert len(outs[0].outputs) == 3 and len({c.text for c in outs[0].outputs}) == 3
    for c in outs[0].outputs:  # each child has its own matcher
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text
    (out,) = llm.generate(PROMPT, SamplingParams(seed=3, max_tokens=20, logprobs=10, structured_outputs=(
        StructuredOutputsParams(choice=["red", "green"]))), use_tqdm=False)
    first = out.outputs[0].logprobs[0]
    allowed = {"r", "re", "red", "g", "gr", "gre", "gree", "green"}
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > float("-inf")}
    # Only tokens the grammar allows carry probability, and it sums to one over them.
    assert finite and all(tokenizer.decode([t]) in allowed for t in finite), finite
    assert sum(2.718281828459045 ** lp for lp in finite.values()) == pytest.approx(1.0, abs=1e-4)


def test_preempted_constrained_requests_stay_valid_and_identical(tiny_model_dir: str) -> None:
    def run(num_kv_blocks: int) -> tuple[dict[str, list[int]], int]:
        # A 48-token budget also splits prompts into chunks (chunked prefill samples nothing).
        core = make_core(tiny_model_dir, max_model_len=256, block_size=16, num_kv_blocks=num_kv_blocks,
                         max_num_batched_tokens=48)
        try:
            prompt = list(range(3, 40))
            reqs = [req(f"j{i}", prompt, _sp(i, json=SCHEMA, disable_any_whitespace=True)) for i in range(8)]
            reqs += [req(f"g{i}", prompt, _sp(i, grammar=ARITHMETIC)) for i in range(8)]
            result = run_to_completion(core, reqs)
            assert all(r.finish_reason == FinishReason.STOP for r in result.results.values())
            return result.tokens(), core.scheduler.num_preemptions
        finally:
            core.shutdown()

    roomy, none = run(256)
    tight, preemptions = run(16)  # 256 KV slots for 16 requests of ~60-100 tokens
    assert none == 0 and preemptions > 0
    assert tight == roomy  # seeded: recompute changes nothing, the matcher state survived it
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for rid, tokens in tight.items():
        text = tokenizer.decode([t for t in tokens if t != EOS])
        if rid.startswith("j"):
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert _is_arithmetic(text), text


class _BrokenMatcher:
    def fill_next_token_bitmask(self, *args: Any) -> bool:
        raise RuntimeError("matcher broke")

    def is_terminated(self) -> bool:
        return False


def test_bad_spec_fails_its_request_alone(tiny_model_dir: str, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    from tidal.core.structured_output import StructuredOutputManager

    new_matcher = StructuredOutputManager._new_matcher
    monkeypatch.setattr(StructuredOutputManager, "_new_matcher", lambda self, r, g: (
        _BrokenMatcher() if r.request_id == "broken" else new_matcher(self, r, g)))
    core = make_core(tiny_model_dir, max_model_len=256)
    try:
        result = run_to_completion(core, [
            req("ok", [5, 6, 7], _sp(1, regex=DATE)),
            req("bad-regex", [5, 6, 7], _sp(2, regex="(unclosed")),
            req("bad-schema", [5, 6, 7], _sp(3, json={"type": "object", "properties": {"a": {"type": 5}}})),
            req("bad-grammar", [5, 6, 7], _sp(4, grammar="root ::= ")),
            req("free", [5, 6, 7], _sp(5, max_tokens=5)),
            req("aborted", [5, 6, 7], _sp(6, json=SCHEMA)),
            req("broken", [5, 6, 7], _sp(7, regex=DATE)),
        ], aborts={0: ["aborted"]})  # while its grammar compiles
    finally:
        core.shutdown()
    assert result["ok"].finish_reason == FinishReason.STOP and result["free"].finish_reason == FinishReason.LENGTH
    assert result["aborted"].finish_reason == FinishReason.ABORT and not result["aborted"].tokens
    broken = result["broken"]
    assert broken.finish_reason == FinishReason.ERROR and not broken.tokens
    assert "filling the token bitmask failed: RuntimeError: matcher broke" in (broken.error or ""), broken.error
    # The first compile loads the tokenizer (seconds): meanwhile the unconstrained request ran.
    assert any("free" in s.num_scheduled_tokens and "ok" not in s.num_scheduled_tokens for s in result.steps)
    for rid, word in (("bad-regex", "regex"), ("bad-schema", "json"), ("bad-grammar", "grammar")):
        r = result[rid]
        assert r.finish_reason == FinishReason.ERROR and not r.tokens, rid
        assert f"invalid structured_outputs.{word}" in (r.error or ""), r.error
    # Through LLM: the error names the problem, and the engine serves the next call.
    with pytest.raises(EngineGenerateError, match=r"invalid structured_outputs\.regex.*parenthesis"):
        llm.generate(PROMPT, _sp(1, regex="(a"), use_tqdm=False)
    (ok,) = llm.generate(PROMPT, _sp(1, regex=DATE), use_tqdm=False)
    assert re.fullmatch(DATE, ok.outputs[0].text)


def test_constraints_that_exclude_the_grammar_are_the_requests_error(llm: LLM) -> None:
    """allowed_token_ids that leave no token the grammar allows: the request fails alone as
    invalid (InvalidRequestError, a ValueError: HTTP 400), not as an engine failure (500)."""
    from tidal.protocol import InvalidRequestError

    params = _sp(1, choice=["yes", "no"])
    params.allowed_token_ids = [EOS]
    with pytest.raises(InvalidRequestError, match="another setting .* may have masked every token"):
        llm.generate(PROMPT, params, use_tqdm=False)
    (ok,) = llm.generate(PROMPT, _sp(1, choice=["yes", "no"]), use_tqdm=False)
    assert ok.outputs[0].text in ("yes", "no")


@pytest.mark.parametrize("vocab, words", [(70, 3), (1000, 32), (1000, 30)])  # 30 words: bits missing
def test_bitmask_applied_exactly_by_both_paths(vocab: int, words: int) -> None:
    import numpy as np
    import torch

    from tidal.worker.logits_processors import apply_token_bitmask, apply_token_bitmask_by_shifts

    rng = np.random.default_rng(vocab + words)
    bitmask = rng.integers(-(2**31), 2**31 - 1, size=(3, words), dtype=np.int32)
    logits, rows = torch.randn(6, vocab), [0, 2, 5]
    expected = logits.clone()
    for i, row in enumerate(rows):
        for t in range(vocab):
            if t >= 32 * words or not (int(bitmask[i, t // 32]) >> (t % 32)) & 1:
                expected[row, t] = float("-inf")
    for apply in (apply_token_bitmask, apply_token_bitmask_by_shifts):  # CPU; accelerators'
        x = logits.clone()
        apply(x, bitmask, rows)
        assert torch.equal(x, expected), apply.__name__


@pytest.mark.parametrize("kwargs, match", [
    (dict(json=SCHEMA, regex=DATE), "only use one kind.*multiple"),
    (dict(choice=["a"], grammar=ARITHMETIC), "only use one kind.*multiple"),
    ({}, "none is specified"),
    (dict(json="{not json"), "json is not valid JSON"),
    (dict(choice=[]), "at least one"),
    (dict(choice="abc"), "list of str"),
    (dict(json_object=False), "must be True"),
])
def test_params_checked_at_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StructuredOutputsParams(**kwargs)


def test_server_response_format_and_structured_outputs(tiny_model_dir: str, tidal_cache_dir: str,
                                                       tmp_path: Any) -> None:
    from tests.server_utils import CHAT_TEMPLATE, Server

    template = tmp_path / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    # The engine-wide whitespace bound, through the CLI flag (vLLM's JSON engine arg).
    srv = Server(tiny_model_dir, ["--max-model-len", "1024", "--num-kv-blocks", "128",
                                  "--chat-template", str(template),
                                  "--structured-outputs-config", '{"backend": "xgrammar", "max_whitespace_cnt": 3}'],
                 tidal_cache_dir)
    try:
        client = srv.client()
        schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
                  "required": ["ok", "n"]}
        res = client.completions.create(
            model=tiny_model_dir, prompt=PROMPT, max_tokens=200, seed=1,
            extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
                        "structured_outputs": {"disable_any_whitespace": True}})
        jsonschema.validate(json.loads(res.choices[0].text), schema)
        # Free whitespace, bounded by the engine's setting or the request's own.
        for seed, body, bound in ((5, {}, 3), (6, {"structured_outputs": {"max_whitespace_cnt": 1}}, 1)):
            res = client.completions.create(model=tiny_model_dir, prompt=PROMPT, max_tokens=200, seed=seed, extra_body={
                "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}, **body})
            jsonschema.validate(json.loads(res.choices[0].text), schema)
            assert max(whitespace_runs(res.choices[0].text), default=0) <= bound, res.choices[0].text
        from transformers import AutoTokenizer

        bias = {str(t): b for t, b in _closing_bias(AutoTokenizer.from_pretrained(tiny_model_dir)).items()}
        res = client.completions.create(
            model=tiny_model_dir, prompt=PROMPT, max_tokens=400, seed=2, logit_bias=bias,
            extra_body={"response_format": {"type": "json_object"},
                        "structured_outputs": {"disable_any_whitespace": True}})
        assert isinstance(json.loads(res.choices[0].text), dict), res.choices[0].text
        res = client.completions.create(model=tiny_model_dir, prompt=PROMPT, max_tokens=400, seed=2, logit_bias=bias,
                                        extra_body={"response_format": {"type": "json_object"}})
        assert isinstance(json.loads(res.choices[0].text), dict), res.choices[0].text
        assert max(whitespace_runs(res.choices[0].text), default=0) <= 3, res.choices[0].text
        res = client.completions.create(model=tiny_model_dir, prompt=PROMPT, max_tokens=20, n=2, seed=3,
                                        extra_body={"structured_outputs": {"choice": CHOICES}})
        assert all(c.text in CHOICES and c.finish_reason == "stop" for c in res.choices)
        chat = client.chat.completions.create(
            model=tiny_model_dir, messages=[{"role": "user", "content": "date?"}], max_tokens=30, seed=4,
            extra_body={"structured_outputs": {"regex": DATE}})
        assert re.fullmatch(DATE, chat.choices[0].message.content or "")
        import openai

        with pytest.raises(openai.BadRequestError, match="only use one kind"):
            client.completions.create(model=tiny_model_dir, prompt=PROMPT, max_tokens=5, extra_body={
                "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}})
        # A spec only the core can find invalid (xgrammar compiles it there): 400 all the same.
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError, match=r"invalid structured_outputs\.regex"):
                res = client.completions.create(model=tiny_model_dir, prompt=PROMPT, max_tokens=5, stream=stream,
                                                extra_body={"structured_outputs": {"regex": "(a"}})
                list(res) if stream else None
    finally:
        srv.stop()
