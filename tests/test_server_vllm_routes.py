"""vLLM's extra server routes and reports on `tidal serve`, against vLLM's documented behaviour
(its serving code and tests are the reference): SageMaker's POST /invocations and /ping, POST
/v1/chat/completions/batch, ORCA `endpoint-load-metrics` headers, server load tracking with GET
/load, GET /tokenizer_info, and usage.prompt_tokens_details.cached_tokens (prefix-cache hits,
whose expected values follow from the block size and the prompt's length).

The null model runner (one token per step) keeps a long request in flight as long as a test needs;
prefix caching is the core's, the same with any runner. The flags' absence is tested in
tests/test_server_flags.py (a server started without them)."""
from __future__ import annotations

import asyncio
import json
import os
import random
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx2 as httpx  # the HTTP library the openai client is built on
import jinja2
import openai
import pytest

from tests.server_utils import CHAT_TEMPLATE, Server, assert_openai_error, http_get, http_request, wait_for

KEY = "sk-routes"
AUTH = {"Authorization": f"Bearer {KEY}"}
BLOCK = 16
LONG = 60000  # null-runner steps: never finishes by itself while a test runs
FLAGS = ["--model-runner", "null", "--max-model-len", "65536", "--num-kv-blocks", "20000", "--block-size",
         str(BLOCK), "--max-num-seqs", "16", "--served-model-name", "m", "--api-key", KEY,
         "--enable-prompt-tokens-details", "--enable-server-load-tracking", "--enable-tokenizer-info-endpoint",
         "--middleware", "tests.test_server_vllm_routes.HoldUntil"]
NO_HANDLER = ("Cannot find suitable handler for request. Expected one of: "
              "['ChatCompletionRequest', 'CompletionRequest']")


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tpl") / "chat.jinja")
    with open(path, "w") as f:
        f.write(CHAT_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(long_model_dir: str, tidal_cache_dir: str, template: str) -> Iterator[Server]:
    srv = Server(long_model_dir, [*FLAGS, "--chat-template", template], tidal_cache_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client(api_key=KEY)


def post(server: Server, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers={**AUTH, **(headers or {})}, timeout=120)


def load(server: Server) -> int:
    status, body = http_get(server.url + "/load")  # no API key: load balancers poll it
    assert status == 200, body
    report = json.loads(body)
    assert set(report) == {"server_load"}
    return report["server_load"]


def sse_payloads(raw: str) -> list[Any]:
    data = [line[6:] for line in raw.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def token_prompt(seed: int, length: int) -> list[int]:
    """A prompt of ordinary token ids no other test's prompt shares a block with."""
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(length)]


def full_blocks(shared_tokens: int, prompt_len: int) -> int:
    """Prefix-cache hits: the full blocks of the shared prefix, the prompt's last token always
    computed (so a prompt hits at most (len - 1) // block_size blocks)."""
    return min(shared_tokens, prompt_len - 1) // BLOCK * BLOCK


# ------------------------------------------------------------- prompt_tokens_details

def test_cached_tokens_in_completions(server: Server, client: openai.OpenAI) -> None:
    a, b = token_prompt(1, 100), token_prompt(2, 100)
    c = a[:40] + token_prompt(3, 60)  # shares 40 tokens (2 full blocks) with a
    first = client.completions.create(model="m", prompt=a, max_tokens=2)
    assert first.usage.prompt_tokens == 100
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # nothing cached yet; vLLM shows the 0
    again = client.completions.create(model="m", prompt=a, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks(100, 100) == 96
    part = client.completions.create(model="m", prompt=c, max_tokens=2)
    assert part.usage.prompt_tokens_details.cached_tokens == full_blocks(40, 100) == 32
    # several prompts: the sum over them, as prompt_tokens is (b is new: 0; a and c: cached whole)
    both = client.completions.create(model="m", prompt=[a, b, c], max_tokens=2)
    assert both.usage.prompt_tokens == 300
    assert both.usage.prompt_tokens_details.cached_tokens == 96 + 0 + 96


def test_cached_tokens_in_completion_streams(server: Server) -> None:
    a = token_prompt(4, 77)
    assert post(server, "/v1/completions", {"prompt": a, "max_tokens": 1}).status_code == 200
    r = post(server, "/v1/completions", {"prompt": a, "max_tokens": 3, "stream": True,
                                         "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    assert r.status_code == 200, r.text
    events = sse_payloads(r.text)
    *chunks, closing = events
    assert closing["choices"] == []
    assert closing["usage"] == {"prompt_tokens": 77, "total_tokens": 80, "completion_tokens": 3,
                                "prompt_tokens_details": {"cached_tokens": full_blocks(77, 77)}}
    # per-chunk usage carries no details (vLLM dumps those chunks with exclude_unset)
    assert chunks and all("prompt_tokens_details" not in c["usage"] for c in chunks)


def _rendered(messages: list[dict[str, str]]) -> str:
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)


def test_cached_tokens_in_chat(server: Server, client: openai.OpenAI, long_model_dir: str) -> None:
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "chat cache " + " ".join(f"word{i}" for i in range(60))}]
    prompt_len = len(AutoTokenizer.from_pretrained(long_model_dir).encode(_rendered(messages),
                                                                         add_special_tokens=False))
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert first.usage.prompt_tokens == prompt_len > 2 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(model="m", messages=messages, max_tokens=2)
    assert again.usage.prompt_tokens_details.cached_tokens == full_blocks(prompt_len, prompt_len)
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    closing = list(stream)[-1]
    assert closing.choices == [] and closing.usage.prompt_tokens == prompt_len
    assert closing.usage.prompt_tokens_details.cached_tokens == full_blocks(prompt_len, prompt_len)


# --------------------------------------------------------------------------- batch

CONVERSATIONS = [[{"role": "user", "content": "Reply with exactly the word: alpha"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "beta?"}]]


def test_batch_answers_each_conversation_as_its_own_chat_request(server: Server, long_model_dir: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(long_model_dir)
    r = post(server, "/v1/chat/completions/batch", {"model": "m", "messages": CONVERSATIONS, "max_tokens": 3,
                                                    "return_token_ids": True},
             {"endpoint-load-metrics-format": "TEXT"})
    assert r.status_code == 200, r.text
    assert "endpoint-load-metrics" not in r.headers  # vLLM's batch route adds no ORCA report
    out = r.json()
    assert out["object"] == "chat.completion" and out["model"] == "m" and out["id"].startswith("chatcmpl-")
    assert [c["index"] for c in out["choices"]] == [0, 1]
    prompt_tokens = 0
    for choice, conversation in zip(out["choices"], CONVERSATIONS):
        single = post(server, "/v1/chat/completions", {"model": "m", "messages": conversation, "max_tokens": 3,
                                                       "return_token_ids": True}).json()
        # the same fields as the conversation's own chat request (the null runner's tokens differ)
        assert set(choice) == set(single["choices"][0])
        assert choice["message"]["role"] == "assistant" and choice["logprobs"] is None
        assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
        assert len(choice["token_ids"]) == 3
        assert choice["message"]["content"] == tok.decode(choice["token_ids"], skip_special_tokens=True)
        prompt_tokens += single["usage"]["prompt_tokens"]
    # summed usage; no prompt_tokens_details (vLLM's batch sets none, flag or not)
    assert out["usage"] == {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + 6,
                            "completion_tokens": 6, "prompt_tokens_details": None}
    assert out["prompt_logprobs"] is None and out["prompt_token_ids"] is None


def test_batch_request_id_echo_and_ignored_fields(server: Server) -> None:
    r = post(server, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 1},
             {"X-Request-Id": "my-batch"})
    assert r.status_code == 200 and r.json()["id"] == "chatcmpl-my-batch"
    prefixed = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "PREFIX "}]
    # echo prepends the last message only where its role is the reply's (vLLM's rule): not the
    # user's prompt under a generated assistant reply, but the assistant prefix a reply continues
    replies = post(server, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 2,
                                                          "echo": True}).json()["choices"]
    assert [c["message"]["role"] for c in replies] == ["assistant", "assistant"]
    assert not any(c["message"]["content"].startswith(("Reply with", "beta?")) for c in replies)
    body = {"messages": [prefixed, prefixed], "max_tokens": 2, "echo": True,
            "add_generation_prompt": False, "continue_final_message": True}
    continued = post(server, "/v1/chat/completions/batch", body).json()["choices"]
    assert all(c["message"]["content"].startswith("PREFIX ") for c in continued)
    # fields vLLM's batch request does not have are ignored: no stream, no prompt_logprobs
    r = post(server, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 1, "stream": True,
                                                    "prompt_logprobs": 1, "n": None})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    assert r.json()["prompt_logprobs"] is None and len(r.json()["choices"]) == 2


@pytest.mark.parametrize("extra,param,message", [
    ({"n": 2}, "n", "Batch chat completions do not support `n > 1`. Please set `n` to 1."),
    ({"use_beam_search": True}, "use_beam_search",
     "Batch chat completions do not support beam search. Please set `use_beam_search` to False."),
    ({"tool_choice": "auto"}, "tool_choice", None),
    ({"messages": []}, "messages", None),
    ({"messages": [[]]}, "messages", None),
    ({"messages": [{"role": "user", "content": "not a list of conversations"}]}, "messages", None),
    ({"model": "other"}, "model", "The model `other` does not exist."),
])
def test_batch_refusals(server: Server, extra: dict[str, Any], param: str, message: str | None) -> None:
    r = post(server, "/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 1, **extra})
    assert_openai_error(r.status_code, r.json(), 404 if param == "model" else 400)
    assert r.json()["error"]["param"] == param
    if message is not None:
        assert r.json()["error"]["message"] == message


# ------------------------------------------------------------------ SageMaker routes

def test_invocations_dispatches_on_the_body(server: Server) -> None:
    chat = {"model": "m", "messages": CONVERSATIONS[0], "max_tokens": 2, "temperature": 0}
    via = post(server, "/invocations", chat)
    direct = post(server, "/v1/chat/completions", chat)
    assert via.status_code == direct.status_code == 200
    assert via.json()["object"] == "chat.completion"
    assert via.json()["choices"] == direct.json()["choices"] and via.json()["usage"] == direct.json()["usage"]
    completion = {"model": "m", "prompt": [11, 12, 13], "max_tokens": 2, "temperature": 0}
    via, direct = post(server, "/invocations", completion), post(server, "/v1/completions", completion)
    assert via.json()["object"] == "text_completion" and via.json()["choices"] == direct.json()["choices"]
    # a body with both is a chat request (vLLM tries ChatCompletionRequest first)
    assert post(server, "/invocations", {**completion, **chat}).json()["object"] == "chat.completion"
    r = post(server, "/invocations", {**chat, "stream": True})
    assert r.headers["content-type"].startswith("text/event-stream")
    assert sse_payloads(r.text)[0]["object"] == "chat.completion.chunk"
    # the endpoint's own checks answer a body of its type
    r = post(server, "/invocations", {**completion, "max_tokens": 10 ** 6})
    assert_openai_error(r.status_code, r.json(), 400)
    assert r.json()["error"]["param"] == "max_tokens"


@pytest.mark.parametrize("body", [{"foo": 1}, [1, 2], {"prompt": ""}, {"prompt": []}, {"messages": "hi"}])
def test_invocations_without_a_handler(server: Server, body: Any) -> None:
    r = post(server, "/invocations", body)
    assert_openai_error(r.status_code, r.json(), 400)
    assert r.json()["error"]["message"] == NO_HANDLER and r.json()["error"]["type"] == "BadRequestError"


def test_invocations_not_json_and_the_key(server: Server) -> None:
    raw = b'{"prompt": '
    try:
        json.loads(raw)
    except json.JSONDecodeError as e:
        python_says = str(e)
    status, body = http_request("POST", server.url + "/invocations", raw, AUTH)
    assert_openai_error(status, json.loads(body), 400)
    assert json.loads(body)["error"]["message"] == f"JSON decode error: {python_says}"
    status, body = http_request("POST", server.url + "/invocations", b'{"prompt": "x"}')
    assert status == 401  # tidal keys every route but the probes
    for method in ("GET", "POST"):  # SageMaker's health probe, open
        assert http_request(method, server.url + "/ping")[0] == 200


# ------------------------------------------------------------------------- ORCA

ORCA_TEXT = re.compile(r"TEXT named_metrics\.num_requests_waiting=(\S+), named_metrics\.kv_cache_usage_perc=(\S+)")


def _check_named(named: dict[str, float]) -> None:
    assert list(named) == ["num_requests_waiting", "kv_cache_usage_perc"]  # the registry's order, as vLLM's
    assert named["num_requests_waiting"] == 0.0  # nothing else was queued
    assert 0.0 <= named["kv_cache_usage_perc"] <= 1.0


def test_orca_header_text_and_json(client: openai.OpenAI, server: Server) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model="m", messages=CONVERSATIONS[0], max_tokens=2, extra_headers={"endpoint-load-metrics-format": "TEXT"})
    m = ORCA_TEXT.fullmatch(raw.headers["endpoint-load-metrics"])
    assert m is not None, raw.headers["endpoint-load-metrics"]
    _check_named({"num_requests_waiting": float(m[1]), "kv_cache_usage_perc": float(m[2])})
    assert raw.parse().choices  # the response itself is unchanged
    for fmt in ("JSON", "json"):  # the format is matched in any case
        raw = client.completions.with_raw_response.create(
            model="m", prompt=[5, 6], max_tokens=2, extra_headers={"endpoint-load-metrics-format": fmt})
        value = raw.headers["endpoint-load-metrics"]
        assert value.startswith("JSON ")
        report = json.loads(value[5:])
        assert list(report) == ["named_metrics"]
        _check_named(report["named_metrics"])
    via = post(server, "/invocations", {"prompt": [5], "max_tokens": 1}, {"endpoint-load-metrics-format": "TEXT"})
    assert ORCA_TEXT.fullmatch(via.headers["endpoint-load-metrics"])


@pytest.mark.parametrize("headers,stream", [({}, False), ({"endpoint-load-metrics-format": "BIN"}, False),
                                            ({"endpoint-load-metrics-format": "TEXT"}, True)])
def test_no_orca_header(server: Server, headers: dict[str, str], stream: bool) -> None:
    r = post(server, "/v1/completions", {"prompt": [5], "max_tokens": 1, "stream": stream}, headers)
    assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers


# ------------------------------------------------------------------- server load

class HoldUntil:
    """The test server's --middleware: a request with `x-hold-until: PATH` has its response's
    last piece held (PATH.reached is made) until PATH exists, so the request is in flight for
    exactly as long as a test wants, whatever the machine's speed."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        gate = dict(scope.get("headers", [])).get(b"x-hold-until") if scope["type"] == "http" else None
        if gate is None:
            return await self.app(scope, receive, send)

        async def held(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                open(gate.decode() + ".reached", "w").close()
                while not os.path.exists(gate.decode()):
                    await asyncio.sleep(0.01)
            await send(message)

        await self.app(scope, receive, held)


def test_load_counts_generation_requests_in_flight(server: Server, tmp_path: Any) -> None:
    assert load(server) == 0
    held = [("/v1/completions", {"prompt": [5, 6], "max_tokens": 2}),
            ("/invocations", {"messages": CONVERSATIONS[0], "max_tokens": 2, "stream": True}),
            ("/v1/chat/completions/batch", {"messages": CONVERSATIONS, "max_tokens": 2}),
            ("/tokenize", {"prompt": "not a generation request"})]
    gates = [str(tmp_path / f"gate{i}") for i in range(len(held))]
    with ThreadPoolExecutor(len(held)) as pool:
        futures = []
        for i, ((path, body), gate) in enumerate(zip(held, gates)):
            futures.append(pool.submit(post, server, path, body, {"x-hold-until": gate}))
            wait_for(lambda: os.path.exists(gate + ".reached"), 120, f"{path}'s response to be held")
            assert load(server) == min(i + 1, 3)  # counted until its response is sent; /tokenize is not
        for gate in gates:
            open(gate, "w").close()
        assert all(f.result(timeout=120).status_code == 200 for f in futures)
    assert load(server) == 0  # each has left the count once its response was sent
    assert post(server, "/v1/completions", {"prompt": [5], "max_tokens": 10 ** 6}).status_code == 400
    assert load(server) == 0  # an error too
    # a client that leaves mid-stream: its count ends with the stream
    with httpx.Client(timeout=120, headers=AUTH) as http:
        with http.stream("POST", server.url + "/v1/completions",
                         json={"prompt": [5], "max_tokens": LONG, "stream": True, "ignore_eos": True},
                         headers={"x-hold-until": gates[0] + "-never"}) as gone:
            assert gone.status_code == 200
            wait_for(lambda: os.path.exists(gates[0] + "-never.reached"), 120, "the stream's end to be held")
            assert load(server) == 1
    wait_for(lambda: load(server) == 0, 60, "the server load to fall back to 0")


# ---------------------------------------------------------------- tokenizer_info

def test_tokenizer_info(server: Server, long_model_dir: str) -> None:
    from transformers import AutoTokenizer

    assert http_get(server.url + "/tokenizer_info")[0] == 401
    status, body = http_get(server.url + "/tokenizer_info", AUTH)
    assert status == 200, body
    info = json.loads(body)
    tok = AutoTokenizer.from_pretrained(long_model_dir)

    def plain(v: Any) -> Any:  # vLLM's rule: an AddedToken as its text
        if hasattr(v, "content"):
            return v.content
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return [plain(x) for x in v] if isinstance(v, list) else v

    want = {k: plain(v) for k, v in tok.init_kwargs.items() if k not in ("vocab_file", "merges_file")}
    want["tokenizer_class"] = type(tok).__name__
    want["chat_template"] = CHAT_TEMPLATE  # the server's --chat-template, over the tokenizer's own
    assert info == want
    assert info["eos_token"] == tok.eos_token and isinstance(info["added_tokens_decoder"], dict)
    tokenized = post(server, "/tokenize", {"prompt": "Hello world!"}).json()
    assert info["model_max_length"] >= tokenized["max_model_len"]  # vLLM's consistency test
