"""Every error status of `tidal serve`, OpenAI-shaped: 400 (validation, context overflow, no
chat template), 401 (API key), 404 (model, route), 413 (body limit), 503 (dead engine)."""
from __future__ import annotations

import json
import signal
from collections.abc import Iterator

import openai
import psutil
import pytest

from tests.server_utils import (
    Server,
    assert_openai_error,
    http_get,
    http_request,
    model_without_chat_template,
    post_json,
    wait_for,
)

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY_LIMIT = 4096
# Request limits lowered (stop strings keep their default, 4) so that requests over them fit the body limit.
LIMITS_ENV = {"TIDAL_MAX_COMPLETION_PROMPTS": "3", "TIDAL_MAX_N_SEQUENCES": "6", "TIDAL_MAX_NUM_BAD_WORDS": "2"}
FLAGS = ["--model-runner", "null", "--max-model-len", "256", "--num-kv-blocks", "128"]


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A keyed server whose model has no chat template, with a small body limit."""
    model = model_without_chat_template(tiny_model_dir, str(tmp_path_factory.mktemp("no-tpl") / "m"))
    srv = Server(model, [*FLAGS, "--max-request-body-bytes", str(BODY_LIMIT), "--served-model-name", "m"],
                 tidal_cache_dir, env={"TIDAL_API_KEY": KEY, **LIMITS_ENV})
    yield srv
    srv.stop()


def completions(server: Server, body: object, headers: dict[str, str] | None = None) -> tuple[int, object]:
    return post_json(server.url + "/v1/completions", body, AUTH if headers is None else headers)


def test_api_key_required_and_checked(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").completions.create(model="m", prompt="hi", max_tokens=2)
    assert info.value.status_code == 401
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        status, body = completions(server, {"prompt": "hi"}, headers)
        assert_openai_error(status, body, 401)
    assert http_get(server.url + "/v1/models")[0] == 401
    assert http_get(server.url + "/health")[0] == 200  # open: probes and scrapers
    assert http_get(server.url + "/metrics")[0] == 200
    ok = server.client(api_key=KEY).completions.create(model="m", prompt="hi", max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_vllms_api_key_variable_is_honoured_first(tiny_model_dir: str, tidal_cache_dir: str) -> None:
    """A deployment keyed the vLLM way (VLLM_API_KEY) is keyed: that key is required, before
    tidal's own variable, and the log says which is in force (never the key)."""
    vllm_key = "sk-vllm-key"
    srv = Server(tiny_model_dir, [*FLAGS, "--served-model-name", "m"], tidal_cache_dir,
                 env={"VLLM_API_KEY": vllm_key, "TIDAL_API_KEY": KEY})
    try:
        status, body = post_json(srv.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert_openai_error(status, body, 401)
        status, body = post_json(srv.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2}, AUTH)
        assert_openai_error(status, body, 401)  # tidal's variable is the fallback, not a second key
        ok = srv.client(api_key=vllm_key).completions.create(model="m", prompt="hi", max_tokens=2)
        assert ok.usage.completion_tokens == 2
        srv.proc.send_signal(signal.SIGTERM)
        srv.proc.wait(60)
        log = srv.output()
    finally:
        srv.stop()
    assert "API key required: from $VLLM_API_KEY ($TIDAL_API_KEY ignored)" in log
    assert vllm_key not in log and KEY not in log


@pytest.mark.parametrize("body, param", [
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "temperature": -1}, None),
    ({"prompt": "hi", "top_p": 0}, None),
    ({"prompt": "hi", "n": 0}, None),
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1.5, 2]}, "prompt"),
    ({"prompt": [1, True]}, "prompt"),  # a bool is no token id
    ({"prompt": [[1, 2], [3, False]]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": [100000]}, None),  # out of the vocabulary: the engine's ValueError
    ({"prompt": "hi", "logprobs": 1000}, None),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
])
def test_validation_errors_are_400(server: Server, body: dict, param: str | None) -> None:
    status, resp = completions(server, body)
    assert_openai_error(status, resp, 400)
    assert resp["error"]["type"] == "BadRequestError"  # type: ignore[index]
    if param is not None:
        assert resp["error"]["param"] == param  # type: ignore[index]


@pytest.mark.parametrize("path, body, param, words", [
    ("/v1/completions", {"prompt": [[1], [2], [3], [4]]}, "prompt", "at most 3 prompts per request"),
    ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt", "at most 3 prompts per request"),
    ("/v1/completions", {"prompt": [1, 2], "n": 7}, "n", "prompts x n must be at most 6"),
    ("/v1/completions", {"prompt": "a", "n": 2**31}, "n", "prompts x n must be at most 6"),  # it hung the server
    ("/v1/completions", {"prompt": ["a", "b"], "n": 4}, "n", "got 2 x 4"),
    ("/v1/completions", {"prompt": "a", "stop": ["1", "2", "3", "4", "5"]}, "stop", "at most 4 stop strings"),
    ("/v1/completions", {"prompt": "a", "bad_words": ["x", "y", "z"]}, "bad_words", "at most 2 bad_words"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [1] * 513}, "allowed_token_ids",
     "allowed_token_ids has 513 entries, more than the vocabulary's 512 tokens"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [2] * 600}, "stop_token_ids", "has 600 entries"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 7}, "n",
     "prompts x n must be at most 6"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "stop": list("abcde")}, "stop",
     "at most 4 stop strings"),
])
def test_requests_over_the_limits_are_400(server: Server, path: str, body: dict, param: str, words: str) -> None:
    """TIDAL_MAX_* (set for this server): refused before any work, naming the field and the limit;
    at the limit, the request is served."""
    status, resp = post_json(server.url + path, body, AUTH)
    assert_openai_error(status, resp, 400)
    assert resp["error"]["param"] == param and words in resp["error"]["message"]  # type: ignore[index]
    status, resp = completions(server, {"prompt": [[1], [2], [3]], "n": 2, "stop": list("abcd"),
                                        "bad_words": ["x", "y"], "max_tokens": 2})
    assert status == 200 and len(resp["choices"]) == 6  # type: ignore[index]
    status, resp = completions(server, {"prompt": [1, 2, 3, 4], "n": 6, "max_tokens": 2})  # ids: one prompt
    assert status == 200 and len(resp["choices"]) == 6  # type: ignore[index]


def test_request_chat_template_needs_the_trust_flag(server: Server) -> None:
    status, body = post_json(server.url + "/v1/chat/completions",
                             {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"}, AUTH)
    assert_openai_error(status, body, 400)
    assert body["error"]["param"] == "chat_template" and "--trust-request-chat-template" in body["error"]["message"]


def test_malformed_json_is_400(server: Server) -> None:
    status, body = http_request("POST", server.url + "/v1/completions", b"{not json", AUTH)
    assert_openai_error(status, json.loads(body), 400)


def test_deeply_nested_body_is_400(server: Server) -> None:
    """JSON nested past what the decoder recurses into is the client's mistake, not a 500."""
    body = b'{"prompt": ' + b"[" * 1500 + b"]" * 1500 + b"}"
    status, raw = http_request("POST", server.url + "/v1/completions", body, AUTH)
    assert_openai_error(status, json.loads(raw), 400)
    assert "nested too deeply" in json.loads(raw)["error"]["message"]
    assert completions(server, {"prompt": "hi", "max_tokens": 2})[0] == 200  # the server is fine


def test_context_overflow_message(server: Server) -> None:
    status, body = completions(server, {"prompt": [1, 2, 3, 4, 5], "max_tokens": 300})
    assert_openai_error(status, body, 400)
    message = body["error"]["message"]  # type: ignore[index]
    assert "300" in message and "256" in message and "5 input tokens" in message
    with pytest.raises(openai.BadRequestError):
        server.client(api_key=KEY).completions.create(model="m", prompt=[1, 2, 3], max_tokens=254)


def test_unknown_model_and_route_are_404(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client(api_key=KEY).completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    status, body = completions(server, {"model": "gpt-4", "prompt": "hi"})
    assert_openai_error(status, body, 404)
    assert body["error"]["param"] == "model"  # type: ignore[index]
    status, raw = http_get(server.url + "/v1/nothing-here", AUTH)
    assert_openai_error(status, json.loads(raw), 404)


def test_body_over_the_limit_is_413(server: Server) -> None:
    status, body = completions(server, {"prompt": "x" * (BODY_LIMIT + 1)})
    assert_openai_error(status, body, 413)
    # The limit holds without a Content-Length too (a chunked body).
    status, raw = http_request("POST", server.url + "/v1/completions",
                               iter([b'{"prompt": "', b"y" * BODY_LIMIT, b'"}']),  # type: ignore[arg-type]
                               {**AUTH, "Transfer-Encoding": "chunked"})
    assert_openai_error(status, json.loads(raw), 413)


def test_chat_without_template_is_400(server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        server.client(api_key=KEY).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert "chat template" in str(info.value) and "--chat-template" in str(info.value)


def test_dead_engine_is_503(long_model_dir: str, tidal_cache_dir: str) -> None:
    srv = Server(long_model_dir, [*FLAGS, "--max-core-restarts", "0"], tidal_cache_dir)  # dead for good
    try:
        cores = [p for p in srv.children() if "tidal.core.core_proc" in " ".join(p.cmdline())]
        assert cores
        for p in cores:
            p.kill()
        psutil.wait_procs(cores, timeout=30)
        wait_for(lambda: http_get(srv.url + "/health")[0] == 503, 60, "/health to answer 503")
        status, body = post_json(srv.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert_openai_error(status, body, 503)
        status, raw = http_get(srv.url + "/health")
        assert_openai_error(status, json.loads(raw), 503)
    finally:
        srv.stop()
