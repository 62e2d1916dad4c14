"""vLLM's request extras and conventions on `tidal serve` (vllm/entrypoints/openai/protocol.py
and serving_*.py are the spec): explicit nulls, stream_options, return_token_ids,
return_tokens_as_token_ids, request ids, chat echo, per-request chat templates, cache_salt,
the fields vLLM refuses, its context-length wording, the API key's forms and /ping."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import pytest

import threading

from tests.server_utils import (
    CHAT_TEMPLATE,
    Server,
    assert_openai_error,
    http_get,
    http_request,
    parse_metrics,
    post_json,
)

KEYS = ("sk-one", "sk-two")
AUTH = {"Authorization": f"Bearer {KEYS[0]}"}
MAX_MODEL_LEN = 256
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = str(tmp_path_factory.mktemp("tpl") / "chat.jinja")
    with open(template, "w") as f:
        f.write(CHAT_TEMPLATE)
    srv = Server(tiny_model_dir, ["--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", "256",
                                  "--chat-template", template, "--served-model-name", "m",
                                  "--api-key", *KEYS, "--trust-request-chat-template"], tidal_cache_dir)
    yield srv
    srv.stop()


def post(server: Server, path: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    status, out = post_json(server.url + path, body, {**AUTH, **(headers or {})})
    assert status == 200, out
    return out


def stream_events(server: Server, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    status, raw = http_request("POST", server.url + path, json.dumps({**body, "stream": True}).encode(),
                               {**AUTH, "Content-Type": "application/json"})
    assert status == 200, raw
    payloads = [line[6:] for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def tokenize_chat(server: Server, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
    return post(server, "/tokenize", {"messages": messages, **extra})["tokens"]


def test_explicit_nulls_take_vllms_defaults(server: Server) -> None:
    """Fields vLLM types Optional accept null (clients that serialise every field send it)."""
    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2, "n": None, "stream": None,
                                                "logprobs": None, "top_logprobs": None})
    assert len(out["choices"]) == 1 and out["choices"][0]["logprobs"] is None
    assert out["usage"]["completion_tokens"] == 2
    out = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 2, "stream": None, "echo": None})
    assert out["object"] == "text_completion" and out["usage"]["completion_tokens"] == 2
    for body in ({"messages": MESSAGES, "ignore_eos": None}, {"messages": MESSAGES, "n": "two"}):
        status, err = post_json(server.url + "/v1/chat/completions", body, AUTH)  # non-Optional in vLLM too
        assert_openai_error(status, err, 400)


def test_stream_options(server: Server) -> None:
    # {} means the defaults, include_usage false (vLLM's StreamOptions): no usage chunk; without
    # stream, {} is no option at all (vLLM)
    assert post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1, "stream_options": {}})["choices"]
    events = stream_events(server, "/v1/completions", {"prompt": [5], "max_tokens": 3, "stream_options": {}})
    assert all(e["choices"] and e.get("usage") is None for e in events)
    events = stream_events(server, "/v1/completions", {"prompt": [5], "max_tokens": 3, "ignore_eos": True,
                                                       "stream_options": {"include_usage": True}})
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3
    assert all(e["usage"] is None for e in events[:-1])
    # continuous_usage_stats: every chunk carries its choice's usage so far
    events = stream_events(server, "/v1/completions", {
        "prompt": [5, 6, 7], "max_tokens": 4, "n": 2, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    seen = {0: 0, 1: 0}
    for e in events[:-1]:
        (choice,) = e["choices"]
        assert e["usage"]["prompt_tokens"] == 3
        assert e["usage"]["completion_tokens"] > seen[choice["index"]]  # one token or more per chunk
        seen[choice["index"]] = e["usage"]["completion_tokens"]
    assert seen == {0: 4, 1: 4} and events[-1]["usage"]["completion_tokens"] == 8
    # continuous_usage_stats counts only along with include_usage (vLLM's should_include_usage)
    events = stream_events(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True,
        "stream_options": {"continuous_usage_stats": True}})
    assert all(e.get("usage") is None for e in events)
    events = stream_events(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert [e["usage"]["completion_tokens"] for e in events[:-1]][-1] == 3
    assert events[0]["usage"]["completion_tokens"] == 0  # the role chunk


def test_return_token_ids(server: Server) -> None:
    """The ids are the tokens that make the text: /detokenize of them gives it back."""
    prompt = [5, 6, 7, 8]
    out = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True,
                                           "return_token_ids": True, "temperature": 0})
    choice = out["choices"][0]
    assert choice["prompt_token_ids"] == prompt and len(choice["token_ids"]) == 5
    assert post(server, "/detokenize", {"tokens": choice["token_ids"]})["prompt"] == choice["text"]
    events = stream_events(server, "/v1/completions", {"prompt": prompt, "max_tokens": 5, "ignore_eos": True,
                                                       "return_token_ids": True, "temperature": 0})
    assert events[0]["choices"][0]["prompt_token_ids"] == prompt
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == choice["token_ids"]  # greedy: the same
    plain = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert plain["choices"][0]["token_ids"] is None and plain["choices"][0]["prompt_token_ids"] is None

    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True,
                                                "return_token_ids": True, "temperature": 0})
    assert out["prompt_token_ids"] == tokenize_chat(server, MESSAGES)
    ids = out["choices"][0]["token_ids"]
    assert len(ids) == 4 and post(server, "/detokenize", {"tokens": ids})["prompt"] == \
        out["choices"][0]["message"]["content"]
    events = stream_events(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 4, "ignore_eos": True,
                                                            "return_token_ids": True, "temperature": 0})
    assert events[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == ids
    # n = 2, with continuous usage: every choice's role chunk has the prompt's ids and the usage
    events = stream_events(server, "/v1/chat/completions", {
        "messages": MESSAGES, "max_tokens": 3, "ignore_eos": True, "n": 2, "return_token_ids": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    roles = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert sorted(e["choices"][0]["index"] for e in roles) == [0, 1]
    assert all(e["prompt_token_ids"] == out["prompt_token_ids"] and e["usage"]["completion_tokens"] == 0
               for e in roles)
    for index in (0, 1):
        chunks = [e for e in events if e["choices"] and e["choices"][0]["index"] == index and e not in roles]
        assert sum(len(e["choices"][0]["token_ids"]) for e in chunks) == 3
        assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_return_tokens_as_token_ids(server: Server) -> None:
    out = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "logprobs": 2, "ignore_eos": True,
                                           "return_tokens_as_token_ids": True, "return_token_ids": True})
    choice = out["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    for top in choice["logprobs"]["top_logprobs"]:
        assert all(re.fullmatch(r"token_id:\d+", k) for k in top)
    body = {"messages": MESSAGES, "max_tokens": 6, "logprobs": True, "top_logprobs": 2, "ignore_eos": True,
            "temperature": 0, "return_token_ids": True}
    out = post(server, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": True})
    content = out["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == [f"token_id:{t}" for t in out["choices"][0]["token_ids"]]
    assert all(re.fullmatch(r"token_id:\d+", t["token"]) for c in content for t in c["top_logprobs"])
    # `bytes` stay the token's own text's, as vLLM's: those of the same (greedy) reply shown as text
    plain = post(server, "/v1/chat/completions", body)["choices"][0]
    assert plain["token_ids"] == out["choices"][0]["token_ids"]
    assert [c["bytes"] for c in content] == [c["bytes"] for c in plain["logprobs"]["content"]]


def test_request_ids(server: Server) -> None:
    """X-Request-Id, else the body's request_id, names the response; reusing one is fine."""
    out = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1}, {"X-Request-Id": "trace-7"})
    assert out["id"] == "cmpl-trace-7"
    out = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "request_id": "mine"})
    assert out["id"] == "chatcmpl-mine"
    events = stream_events(server, "/v1/completions", {"prompt": [5], "max_tokens": 2, "request_id": "mine"})
    assert {e["id"] for e in events} == {"cmpl-mine"}
    assert post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1})["id"].startswith("cmpl-")
    # one caller id on two requests in flight together: both served, both named by it
    results: list[Any] = []

    def run() -> None:
        results.append(stream_events(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 40,
                                                                 "ignore_eos": True, "request_id": "same"}))

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2
    for events in results:
        assert {e["id"] for e in events} == {"cmpl-same"}
        assert [e["choices"][0]["finish_reason"] for e in events][-1] == "length"  # ran to the end


def test_chat_echo_and_request_template(server: Server) -> None:
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    body = {"messages": convo, "max_tokens": 3, "temperature": 0, "add_generation_prompt": False}
    plain = post(server, "/v1/chat/completions", body)["choices"][0]["message"]
    echoed = post(server, "/v1/chat/completions", {**body, "echo": True})["choices"][0]["message"]
    assert plain["role"] == echoed["role"] == "assistant" and echoed["content"] == "Once upon" + plain["content"]
    user_last = {"messages": MESSAGES, "max_tokens": 2, "temperature": 0}
    assert post(server, "/v1/chat/completions", {**user_last, "echo": True})["choices"][0]["message"] == \
        post(server, "/v1/chat/completions", user_last)["choices"][0]["message"]  # the user's turn: not echoed
    events = stream_events(server, "/v1/chat/completions", {**body, "echo": True})
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == echoed["content"]
    # a request's own template (the server trusts them): what it renders is the prompt
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    ids = post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 1, "chat_template": template,
                                                "return_token_ids": True})["prompt_token_ids"]
    assert ids == post(server, "/tokenize", {"prompt": "[hi]", "add_special_tokens": False})["tokens"]
    # an assistant turn that only called tools renders with empty content, as vLLM
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": None, "tool_calls": []},
             {"role": "user", "content": "b"}]
    assert tokenize_chat(server, turns) == tokenize_chat(server, [turns[0], {**turns[1], "content": ""}, turns[2]])


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": "a", "use_beam_search": True}, "use_beam_search", "not supported"),
    ("/v1/completions", {"prompt": "a", "logits_processors": ["m.P"]}, "logits_processors", "not supported"),
    ("/v1/completions", {"prompt": "a", "cache_salt": ""}, "cache_salt", "non-empty string"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": False}}, "stream_options", "stream=True"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "auto"}, "tool_choice", "`tools` must be set"),
    # tools (tool_choice "auto" by default) on a server started without a tool-call parser
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "tool_choice", "requires --enable-auto-tool-choice and --tool-call-parser"),
    ("/v1/completions", {"prompt": [5] * (MAX_MODEL_LEN + 4)}, None,
     f"maximum context length is {MAX_MODEL_LEN} tokens. However, your request has {MAX_MODEL_LEN + 4} input tokens"),
])
def test_refused_fields(server: Server, path: str, body: dict, param: str | None, words: str) -> None:
    status, err = post_json(server.url + path, body, AUTH)
    assert_openai_error(status, err, 400)
    assert err["error"]["param"] == param and words in err["error"]["message"], err


def test_stream_with_zero_prompt_logprobs_is_allowed(server: Server) -> None:
    events = stream_events(server, "/v1/completions", {"prompt": [5], "max_tokens": 2, "prompt_logprobs": 0})
    assert events and all("error" not in e for e in events)


def test_cache_salt_isolates_prefix_cache_hits(server: Server) -> None:
    """Counted by the server's own prefix-cache counter: a salt hits only its own blocks."""
    ids = list(range(300, 340))  # 2 full blocks of 16 can hit (the last token is recomputed)

    def hits_after(body: dict[str, Any]) -> float:
        before = parse_metrics(http_get(server.url + "/metrics")[1].decode())["vllm:prefix_cache_hits_total"]
        post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, **body})
        return parse_metrics(http_get(server.url + "/metrics")[1].decode())["vllm:prefix_cache_hits_total"] - before

    assert hits_after({"cache_salt": "tenant-a"}) == 0
    assert hits_after({"cache_salt": "tenant-a", "n": 2}) == 64  # both children hit: n > 1 keeps the salt
    assert hits_after({"cache_salt": "tenant-b"}) == 0
    assert hits_after({}) == 0


def test_api_key_forms_and_ping(server: Server) -> None:
    for value in (f"Bearer {KEYS[0]}", f"bearer {KEYS[1]}", f"BEARER {KEYS[0]}"):
        assert http_get(server.url + "/v1/models", {"Authorization": value})[0] == 200, value
    for value in (f"Basic {KEYS[0]}", KEYS[0], "Bearer sk-three", "Bearer ", f"Bearer {KEYS[0]}x"):
        assert http_get(server.url + "/v1/models", {"Authorization": value})[0] == 401, value
    assert http_get(server.url + "/ping")[0] == 200  # open, as /health
    assert http_request("POST", server.url + "/ping", b"")[0] == 200


def test_api_keys_must_not_be_empty() -> None:
    from starlette.applications import Starlette

    from tidal.frontend.entrypoints.cli import build_parser
    from tidal.frontend.entrypoints.openai.api_server import APIKeyMiddleware
    from tidal.frontend.entrypoints.openai.server_flags import check_server_flags

    with pytest.raises(ValueError, match="--api-key: an empty key"):
        check_server_flags(build_parser().parse_args(["serve", "m", "--api-key", "k", ""]))
    with pytest.raises(ValueError, match="non-empty"):
        APIKeyMiddleware(Starlette(), ["k", ""])
