"""How `tidal serve` reads a request's inputs, as vLLM's server does (vllm/entrypoints/openai/
{completion,chat_completion}/protocol.py and serve/utils/api_utils.py are the spec): usage in
streams (stream_options, --enable-force-include-usage), lenient typing (pydantic's lax mode),
truncation_side, the words for a value out of its bounds, and a restarting engine's 503."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.server_utils import CHAT_TEMPLATE, Server, assert_openai_error, http_request, post_json
from tidal.frontend import keep_last, truncation_length
from tidal.frontend.entrypoints.openai.errors import from_exception
from tidal.frontend.entrypoints.openai.protocol import CompletionRequest, StreamOptions
from tidal.frontend.entrypoints.openai.sse import should_include_usage
from tidal.frontend.entrypoints.openai.usage_details import DetailsFraming
from tidal.protocol.errors import EngineDeadError, EngineRestartingError

MESSAGES = [{"role": "user", "content": "hello there, how are you today?"}]
TEXT = "one two three four five six seven"


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = str(tmp_path_factory.mktemp("tpl") / "chat.jinja")
    with open(template, "w") as f:
        f.write(CHAT_TEMPLATE)
    srv = Server(tiny_model_dir, ["--max-model-len", "256", "--num-kv-blocks", "128", "--max-num-seqs", "8",
                                  "--chat-template", template, "--served-model-name", "m"], tidal_cache_dir)
    yield srv
    srv.stop()


def post(server: Server, path: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = post_json(server.url + path, body)
    assert status == 200, out
    return out


def refused(server: Server, path: str, body: dict[str, Any], param: str | None) -> str:
    status, out = post_json(server.url + path, body)
    assert_openai_error(status, out, 400)
    assert out["error"]["param"] == param, out
    return out["error"]["message"]


def events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, raw = http_request("POST", server.url + path, json.dumps({**body, "stream": True}).encode())
    assert status == 200, raw
    payloads = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def usage_chunks(evs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in evs if e.get("usage") is not None]


def tokens(server: Server, body: dict[str, Any]) -> list[int]:
    return post(server, "/tokenize", body)["tokens"]


# ------------------------------------------------------------------ usage in streams
def test_stream_options_usage_as_vllm(server: Server) -> None:
    """`stream_options: {}` asks for no usage (include_usage defaults to false); include_usage
    true ends the stream with exactly one usage chunk, counts right; continuous_usage_stats
    counts only along with include_usage."""
    prompt_len = len(tokens(server, {"prompt": TEXT}))
    chat_len = len(tokens(server, {"messages": MESSAGES}))
    for path, body, n_prompt in (("/v1/completions", {"prompt": TEXT}, prompt_len),
                                 ("/v1/chat/completions", {"messages": MESSAGES}, chat_len)):
        base = {**body, "max_tokens": 3, "ignore_eos": True}
        for options in ({}, {"include_usage": False}, {"continuous_usage_stats": True}, {"include_usage": None}):
            evs = events(server, path, {**base, "stream_options": options})
            assert evs and not usage_chunks(evs) and all(e["choices"] for e in evs), (path, options, evs)
        evs = events(server, path, {**base, "stream_options": {"include_usage": True}})
        (closing,) = usage_chunks(evs)
        assert closing is evs[-1] and closing["choices"] == []
        assert closing["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 3, "total_tokens": n_prompt + 3}
        assert all("usage" in e and e["usage"] is None for e in evs[:-1])  # OpenAI's: null until the last
        # without `stream`, `{}` is no option at all (vLLM's check is the object's truthiness)
        assert post(server, path, {**base, "stream_options": {}})["usage"]["completion_tokens"] == 3
        assert refused(server, path, {**base, "stream_options": {"include_usage": True}}, "stream_options")


def test_force_include_usage_is_vllms_should_include_usage() -> None:
    """--enable-force-include-usage (ChatOptions.force_include_usage, passed to StreamFraming):
    vLLM's should_include_usage returns (True, True) with it, so every chunk carries the usage
    so far and a usage chunk ends the stream, whatever stream_options says."""
    opts = StreamOptions
    assert should_include_usage(None, False) == (False, False)
    assert should_include_usage(opts(), False) == (False, False)
    assert should_include_usage(opts(include_usage=True), False) == (True, False)
    assert should_include_usage(opts(include_usage=True, continuous_usage_stats=True), False) == (True, True)
    assert should_include_usage(opts(include_usage=False, continuous_usage_stats=True), False) == (False, False)
    for options in (None, opts(), opts(include_usage=False, continuous_usage_stats=False)):
        assert should_include_usage(options, True) == (True, True)
    framing = DetailsFraming("text_completion", "cmpl-1", "m", CompletionRequest(prompt="x", stream=True), True)
    assert framing.with_usage and framing.continuous
    tail = json.loads(b'{"choices":[' + framing.tail(4, 2)[:-2])  # a chunk's tail carries the usage
    assert tail["usage"] == {"prompt_tokens": 4, "total_tokens": 6, "completion_tokens": 2}
    plain = DetailsFraming("text_completion", "cmpl-1", "m", CompletionRequest(prompt="x", stream=True,
                                                                           stream_options=opts()), False)
    assert not plain.with_usage and plain.tail(4, 2) == b"]}\n\n"


# ------------------------------------------------------------------ lenient typing
def test_lenient_inputs_as_pydantic_lax_mode(server: Server) -> None:
    """What vLLM's pydantic models coerce is taken: "true" for a bool, numeric strings, an int
    for a float, 2.0 for an int; what they refuse stays a 400 naming the field."""
    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": "3", "logprobs": "true",
                                                "top_logprobs": 2, "temperature": "0.5", "ignore_eos": "1"})
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == 3 and all(len(c["top_logprobs"]) == 2 for c in content)
    out = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": "4", "temperature": 0, "top_p": 1,
                                           "n": 2.0, "echo": "false", "ignore_eos": True, "seed": "7"})
    assert len(out["choices"]) == 2 and out["usage"]["completion_tokens"] == 8
    assert not out["choices"][0]["text"].startswith(TEXT)
    for body, param in (({"max_tokens": 2.5}, "max_tokens"), ({"max_tokens": "2.5"}, "max_tokens"),
                        ({"n": "two"}, "n"), ({"user": 5}, "user"), ({"echo": "maybe"}, "echo"),
                        ({"ignore_eos": 2}, "ignore_eos")):
        refused(server, "/v1/completions", {"prompt": TEXT, **body}, param)


# ------------------------------------------------------------------ truncation_side
def test_truncation_side(server: Server) -> None:
    """truncate_prompt_tokens keeps the last N tokens ("left", and by default, as vLLM's
    generation tokenizers); truncation_side "right" keeps the first N: text and token-id
    prompts, and chat."""
    full = tokens(server, {"prompt": TEXT})
    assert len(full) > 4
    for side, kept in ((None, full[-4:]), ("left", full[-4:]), ("right", full[:4])):
        extra = {} if side is None else {"truncation_side": side}
        out = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 1, "truncate_prompt_tokens": 4,
                                               "return_token_ids": True, **extra})
        assert out["choices"][0]["prompt_token_ids"] == kept and out["usage"]["prompt_tokens"] == 4, side
    out = post(server, "/v1/completions", {"prompt": [[5, 6, 7, 8, 9], [10, 11]], "max_tokens": 1,
                                           "truncate_prompt_tokens": 3, "truncation_side": "right",
                                           "return_token_ids": True})
    assert [c["prompt_token_ids"] for c in out["choices"]] == [[5, 6, 7], [10, 11]]
    chat = tokens(server, {"messages": MESSAGES})
    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "truncate_prompt_tokens": 5,
                                                "truncation_side": "right", "return_token_ids": True})
    assert out["prompt_token_ids"] == chat[:5] and out["usage"]["prompt_tokens"] == 5
    # -1: the context window, whose whole prompt fits here
    out = post(server, "/v1/completions", {"prompt": TEXT, "max_tokens": 1, "truncate_prompt_tokens": -1,
                                           "truncation_side": "right", "return_token_ids": True})
    assert out["choices"][0]["prompt_token_ids"] == full
    refused(server, "/v1/completions", {"prompt": TEXT, "truncation_side": "middle"}, "truncation_side")


def test_truncation_length_sides() -> None:
    keep = truncation_length(2, 8, "right")
    assert keep == 2 and keep_last([1, 2, 3], keep) == [1, 2]
    assert keep_last([1, 2, 3], truncation_length(2, 8, "left")) == [2, 3]
    assert keep_last([1, 2, 3], truncation_length(2, 8)) == [2, 3]
    assert keep_last([1, 2, 3], truncation_length(-1, 2, "right")) == [1, 2]
    with pytest.raises(ValueError, match="truncation_side must be 'left' or 'right'"):
        truncation_length(2, 8, "middle")


# ------------------------------------------------------------------ bounds, in vLLM's words
def test_values_out_of_bounds_in_vllms_words(server: Server) -> None:
    """pydantic's words for vLLM's Field(ge=..., le=...) bounds (type greater_than_equal, ...),
    vLLM's check_logprobs words for logprobs, SamplingParams' words for the rest (vLLM puts no
    pydantic bound on n or max_tokens: its SamplingParams answers "n must be at least 1")."""
    cmpl, chat = "/v1/completions", "/v1/chat/completions"
    message = refused(server, cmpl, {"prompt": TEXT, "truncate_prompt_tokens": -2}, "truncate_prompt_tokens")
    assert "Input should be greater than or equal to -1" in message and "greater_than_equal" in message
    message = refused(server, cmpl, {"prompt": [5, -1]}, "prompt")
    assert message.startswith("prompt.1: Input should be greater than or equal to 0 [type=greater_than_equal")
    assert "prompt.1.0: Input should be greater than or equal to 0" in refused(server, cmpl, {"prompt": [[5], [-2]]},
                                                                                "prompt")
    message = refused(server, cmpl, {"prompt": TEXT, "seed": 2**63}, "seed")
    assert "seed: Input should be less than or equal to 9223372036854775807 [type=less_than_equal]" == message
    assert "Input should be greater than or equal to" in refused(server, chat, {"messages": MESSAGES,
                                                                                "priority": -2**63 - 1}, "priority")
    assert refused(server, chat, {"messages": MESSAGES, "logprobs": True, "top_logprobs": -2},
                   "top_logprobs") == "`top_logprobs` must be a positive value or -1."
    assert refused(server, cmpl, {"prompt": TEXT, "logprobs": -3}, "logprobs") == \
        "`logprobs` must be a positive value or -1."
    assert refused(server, cmpl, {"prompt": TEXT, "prompt_logprobs": -2, "stream": True},
                   "prompt_logprobs") == "`prompt_logprobs` must be a positive value or -1."
    assert "n must be at least 1, got -1" in refused(server, cmpl, {"prompt": TEXT, "n": -1}, None)
    assert "n must be at least 1, got 0" in refused(server, chat, {"messages": MESSAGES, "n": "0"}, None)


# ------------------------------------------------------------------ a restarting engine
def test_engine_restarting_is_503_with_retry_after() -> None:
    from tidal.frontend.entrypoints.openai.api_server import error_response

    err = from_exception(EngineRestartingError("the engine core is being restarted"))
    assert int(err.status) == 503 and err.message.startswith("The engine is restarting")
    assert "being restarted" in err.message and int(err.headers["Retry-After"]) >= 1
    body = json.loads(err.encode())["error"]
    assert body["type"] == "ServiceUnavailableError" and body["code"] == 503
    assert error_response(err).headers["retry-after"] == err.headers["Retry-After"]
    dead = from_exception(EngineDeadError())
    assert int(dead.status) == 503 and dead.message.startswith("The engine is dead") and not dead.headers
