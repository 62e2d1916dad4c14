"""JSON outputs close on a code-trained vocabulary: the whitespace between JSON tokens is bounded.

The model is Qwen3-shaped with random weights and a byte-level BPE vocabulary trained here on
generated Python-like source, so it holds tokens of 1-15 spaces and of newlines plus
indentation. Unbounded (xgrammar's default, tidal's before the bound), temperature-1 requests
spend their tokens on whitespace after "{" and run to max_tokens with text that does not parse:
all 50 of the 50 seeded requests below did under this schema with max_tokens=300. With the default bound
(structured_outputs_config.max_whitespace_cnt, 20) every output parses, validates (jsonschema)
and ends within max_tokens; per-request options narrow or remove the whitespace.
"""
from __future__ import annotations

import argparse
import json
import os
import random
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tidal.frontend import LLM, AsyncEngineArgs, EngineArgs
from tidal.protocol import SamplingParams, StructuredOutputsParams
from tidal.protocol.config import EngineConfig

# The engine's default bound (protocol.config.DEFAULT_MAX_WHITESPACE_CNT, checked below); a
# literal here so that the behavioural tests run, and fail, on code without the option.
DEFAULT_BOUND = 20

# A form's fields (tests/test_structured_outputs.py builds its schema on them too).
FORM_PROPERTIES: dict[str, Any] = {
    "name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 3},
}
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {**FORM_PROPERTIES, "active": {"type": "boolean"}},
    "required": ["name", "age", "role"],
}
MAX_TOKENS = 300
PROMPT = "Fill in the form:"
_NAMES = ["value", "item", "result", "self", "data", "key", "index", "count", "name", "node", "path", "line"]
_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # make_model's special tokens, ids 0-2


def python_like_source(seed: int) -> str:
    """Indented blocks (2- or 4-space units, up to 16 spaces) and comments aligned with runs of
    2-16 spaces: what a BPE trainer turns into long whitespace tokens, as on real code."""
    rng = random.Random(seed)
    unit = rng.choice((2, 4))
    lines: list[str] = []
    depth = 0
    for _ in range(300):
        a, b = rng.choice(_NAMES), rng.choice(_NAMES)
        pad = " " * (unit * depth)
        r = rng.random()
        if r < 0.25 and unit * (depth + 1) <= 16:
            lines.append(f"{pad}{rng.choice(['if', 'for', 'while', 'with', 'def', 'class'])} {a}_{b}({a}, {b}):")
            depth += 1
        elif r < 0.4 and depth > 0:
            lines.append(f"{pad}return {a}.{b}({rng.randint(0, 99)})")
            depth -= rng.randint(1, depth)
        elif r < 0.5:
            lines.append("")
        else:
            lines.append(f"{pad}{a} = {b}[{rng.randint(0, 9)}]" + " " * rng.randint(2, 16) + f"# {rng.choice(_NAMES)}")
    return "\n".join(lines) + "\n"


def whitespace_runs(text: str) -> list[int]:
    """The lengths of the whitespace runs between JSON tokens (outside string literals)."""
    runs: list[int] = []
    run, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in " \t\n\r":
            run += 1
            continue
        if run:
            runs.append(run)
            run = 0
        in_string = ch == '"'
    return runs + [run] if run else runs


@pytest.fixture(scope="module")
def code_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    from tidal.frontend.entrypoints.make_model import make_model

    tok_dir = str(tmp_path_factory.mktemp("code-tokenizer"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([python_like_source(seed) for seed in range(60)], trainer)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    spaces = {len(t) for t in (tok.decode([i]) for i in range(tok.get_vocab_size())) if t and set(t) == {" "}}
    assert {2, 4, 8, 12, 15} <= spaces, sorted(spaces)  # the vocabulary this test is about
    return make_model(str(tmp_path_factory.mktemp("code-qwen3")), "qwen3", vocab_size=512, hidden_size=64,
                      num_layers=2, tokenizer_dir=tok_dir, seed=0)


@pytest.fixture(scope="module")
def llm(code_model_dir: str) -> Iterator[LLM]:
    with LLM(model=code_model_dir, max_model_len=1024) as engine:
        yield engine


def _sp(seed: int, max_tokens: int = MAX_TOKENS, **constraint: Any) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**constraint))


def test_json_schema_outputs_close_with_the_default_bound(llm: LLM) -> None:
    """The issue's check: 50 seeded temperature-1 requests, every output parses and validates
    within max_tokens (on the old code most ran to max_tokens inside whitespace)."""
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * 50, [_sp(i, json=SCHEMA) for i in range(50)],
                                               use_tqdm=False)]
    bad = []
    for seed, c in enumerate(outs):
        try:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        except (ValueError, jsonschema.ValidationError) as e:  # not JSON; JSON off the schema
            bad.append((seed, c.finish_reason, len(c.token_ids), f"{e}"[:60], c.text[:80]))
    assert not bad, f"{len(bad)} of 50 outputs do not parse and validate: {bad[:3]}"
    assert all(c.finish_reason == "stop" and len(c.token_ids) <= MAX_TOKENS for c in outs)
    runs = [r for c in outs for r in whitespace_runs(c.text)]
    # Whitespace is still free (pretty-printed JSON stays possible), only bounded per gap.
    assert max(runs) <= DEFAULT_BOUND and any(r > 1 for r in runs), sorted(runs)[-5:]


def test_engine_wide_disable_any_whitespace(code_model_dir: str) -> None:
    """The issue's engine arg, structured_outputs_config={"backend": "xgrammar",
    "disable_any_whitespace": true}: every JSON output is in xgrammar's one compact layout."""
    params = [_sp(i, json=SCHEMA) for i in range(8)]
    with LLM(model=code_model_dir, max_model_len=1024,
             structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True}) as engine:
        outs = [o.outputs[0] for o in engine.generate([PROMPT] * len(params), params, use_tqdm=False)]
    for c in outs:
        assert c.finish_reason == "stop" and c.text == json.dumps(json.loads(c.text)), c.text[:200]
        jsonschema.validate(json.loads(c.text), SCHEMA)


def test_per_request_bound_and_compact_layout(llm: LLM) -> None:
    params = [_sp(i, json=SCHEMA, max_whitespace_cnt=2) for i in range(8)]
    params += [_sp(i, json=SCHEMA, disable_any_whitespace=True) for i in range(8)]
    outs = [o.outputs[0] for o in llm.generate([PROMPT] * len(params), params, use_tqdm=False)]
    for c in outs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert all(max(whitespace_runs(c.text), default=0) <= 2 for c in outs[:8]), [c.text for c in outs[:8]]
    # No free whitespace: xgrammar's one layout, which is json.dumps's (", " and ": ").
    assert all(c.text == json.dumps(json.loads(c.text)) for c in outs[8:]), [c.text for c in outs[8:]]


def test_json_object_is_bounded_too(llm: LLM) -> None:
    tokenizer = llm.get_tokenizer()
    # A random model left alone rarely closes a string: bias it toward closing strings and
    # objects (any object is what json_object allows).
    bias = {tokenizer.convert_tokens_to_ids(t): 6.0 for t in ('"', "}")}
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=400, logit_bias=bias,
                             structured_outputs=StructuredOutputsParams(json_object=True, max_whitespace_cnt=4))
              for i in range(8)]
    for out in llm.generate([PROMPT] * len(params), params, use_tqdm=False):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and isinstance(json.loads(c.text), dict), c.text
        assert max(whitespace_runs(c.text), default=0) <= 4, c.text


def test_engine_config_and_request_options_merge() -> None:
    """The engine's structured_outputs_config sets the defaults; a request's options win
    (disable_any_whitespace: either turns free whitespace off)."""
    from tidal.core.structured_output import StructuredOutputManager
    from tidal.protocol.config import DEFAULT_MAX_WHITESPACE_CNT, StructuredOutputsConfig

    def key(engine: StructuredOutputsConfig, **request: Any) -> tuple[bool, int | None]:
        som = StructuredOutputManager(EngineConfig(model="m", structured_outputs_config=engine), 512)
        _, _, any_ws, bound = som.grammar_key(StructuredOutputsParams(json=SCHEMA, **request))
        return any_ws, bound

    assert DEFAULT_MAX_WHITESPACE_CNT == DEFAULT_BOUND
    default = StructuredOutputsConfig()
    assert key(default) == (True, DEFAULT_BOUND)
    assert key(default, max_whitespace_cnt=3) == (True, 3)
    assert key(default, disable_any_whitespace=True) == (False, None)
    assert key(StructuredOutputsConfig(max_whitespace_cnt=None)) == (True, None)  # unbounded, as vLLM
    assert key(StructuredOutputsConfig(max_whitespace_cnt=7), max_whitespace_cnt=2) == (True, 2)
    assert key(StructuredOutputsConfig(disable_any_whitespace=True), max_whitespace_cnt=2) == (False, None)


def test_structured_outputs_config_engine_arg() -> None:
    from tidal.protocol.config import StructuredOutputsConfig

    cfg = EngineArgs(model="/m", structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True,
                                                           "max_whitespace_cnt": 8}).create_engine_config()
    assert cfg.structured_outputs_config == StructuredOutputsConfig(backend="xgrammar", disable_any_whitespace=True,
                                                                    max_whitespace_cnt=8)
    assert type(cfg).from_json(cfg.to_json()) == cfg  # it travels to the core as JSON
    parser = AsyncEngineArgs.add_cli_args(argparse.ArgumentParser())
    ns = parser.parse_args(["--structured-outputs-config", '{"max_whitespace_cnt": null}',
                            "--grammar-compile-timeout-s", "5"])
    cfg = AsyncEngineArgs.from_cli_args(ns).create_engine_config()
    assert cfg.structured_outputs_config.max_whitespace_cnt is None and cfg.grammar_compile_timeout_s == 5.0
    assert EngineArgs(model="/m").create_engine_config().structured_outputs_config == StructuredOutputsConfig()
    for bad, match in [({"backend": "guidance"}, "only structured-output backend is xgrammar"),
                       ({"max_whitespace_cnt": 0}, "max_whitespace_cnt must be an integer >= 1"),
                       ({"disable_any_whitespce": True}, "unknown key.*disable_any_whitespce"),
                       ({"reasoning_parser": "qwen3"}, "reasoning parsers")]:
        with pytest.raises(ValueError, match=match):
            EngineArgs(model="/m", structured_outputs_config=bad).create_engine_config()


@pytest.mark.parametrize("value", [0, -1, True, 2.5, "3"])
def test_request_bound_checked_at_construction(value: Any) -> None:
    with pytest.raises(ValueError, match="max_whitespace_cnt must be an integer >= 1"):
        StructuredOutputsParams(json=SCHEMA, max_whitespace_cnt=value)
