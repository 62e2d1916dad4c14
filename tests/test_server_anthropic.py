"""POST /v1/messages (Anthropic's Messages API) through the official `anthropic` client against
one `tidal serve` (the tiny Qwen3 model, started with an API key, tool and reasoning parsers):
streamed and whole replies alike with exact usage, Anthropic's event order, stop_sequences,
max_tokens, a forced tool's tool_use block valid for its schema, tool_result turns through the
chat template, thinking blocks, count_tokens, x-api-key and Anthropic-shaped errors.

The model's weights are random, so replies are held to a fixed length (ignore_eos) or to a text
(a regex constraint, vLLM's structured_outputs, sent as the client's extra_body)."""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from tests.server_utils import Server, http_request, post_json, wait_for

MODEL = "tiny"
KEY = "sk-test-anthropic"
NO_THINK = {"enable_thinking": False}  # the template closes the thinking: the reply is content
TOOL_FLAGS = ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
FIXED = {"ignore_eos": True, "seed": 7, "chat_template_kwargs": NO_THINK}
HI = [{"role": "user", "content": "Hello there."}]
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
    "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "The weather in a city.", "input_schema": WEATHER},
         {"name": "get_time", "description": "The time in a zone.",
          "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}]


def forced(text: str) -> dict[str, Any]:
    """extra_body that makes the model write exactly `text`."""
    return {"structured_outputs": {"regex": re.escape(text)}, "chat_template_kwargs": NO_THINK}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str) -> Iterator[Server]:
    srv = Server(tiny_model_dir, ["--max-model-len", "2048", "--num-kv-blocks", "1024", "--max-num-seqs", "4",
                                  "--served-model-name", MODEL, "--api-key", KEY, *TOOL_FLAGS,
                                  "--reasoning-parser", "qwen3"], tidal_cache_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


def chat_prompt_tokens(server: Server, messages: list[dict[str, Any]], **fields: Any) -> int:
    """The chat route's prompt token count for `messages` (OpenAI's shape), by /tokenize."""
    status, body = post_json(server.url + "/tokenize", {"model": MODEL, "messages": messages, **fields},
                             {"x-api-key": KEY})
    assert status == 200, body
    return int(body["count"])


def raw_stream(server: Server, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of each event of a streamed request, pings included."""
    status, raw = http_request("POST", server.url + "/v1/messages", json.dumps({**body, "stream": True}).encode(),
                               {"x-api-key": KEY})
    assert status == 200, raw
    events = []
    for frame in raw.decode().split("\n\n"):
        if frame.strip():
            name_line, data_line = frame.split("\n")
            assert name_line.startswith("event: ") and data_line.startswith("data: "), frame
            events.append((name_line[7:], json.loads(data_line[6:])))
    return events


def check_order(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Anthropic's sequence; returns the blocks the events build."""
    names = [name for name, _ in events]
    assert all(name == data["type"] for name, data in events), events
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    blocks: list[dict[str, Any]] = []
    open_index = None
    for name, data in events[2:-2]:
        if name == "content_block_start":
            assert open_index is None and data["index"] == len(blocks)
            open_index = data["index"]
            blocks.append(dict(data["content_block"]))
        elif name == "content_block_delta":
            assert data["index"] == open_index
            block, delta = blocks[open_index], data["delta"]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json",
                   "signature_delta": "signature"}[delta["type"]]
            assert {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "tool_use",
                    "signature_delta": "thinking"}[delta["type"]] == block["type"]
            block[key] = block.get(key, "") + delta[key] if key != "signature" else delta[key]
        else:
            assert name == "content_block_stop" and data["index"] == open_index, (name, data)
            open_index = None
    assert open_index is None
    return blocks


def test_streamed_and_whole_replies_alike(server: Server, client: anthropic.Anthropic) -> None:
    whole = client.messages.create(model=MODEL, max_tokens=12, messages=HI, extra_body=FIXED)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL and whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.usage.input_tokens == chat_prompt_tokens(server, HI, chat_template_kwargs=NO_THINK)
    assert whole.usage.output_tokens == 12
    with client.messages.stream(model=MODEL, max_tokens=12, messages=HI, extra_body=FIXED) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == whole.content[0].text
    assert [b.to_dict(exclude_none=True) for b in final.content] == [{"type": "text", "text": streamed_text}]
    assert final.usage.to_dict() == whole.usage.to_dict() and final.stop_reason == "max_tokens"
    events = raw_stream(server, {"model": MODEL, "max_tokens": 12, "messages": HI, **FIXED})
    blocks = check_order(events)
    assert blocks == [{"type": "text", "text": whole.content[0].text}]
    assert events[0][1]["message"]["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 0}
    assert events[-2][1]["usage"] == {"input_tokens": whole.usage.input_tokens, "output_tokens": 12}
    assert events[-2][1]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    counted = client.messages.count_tokens(model=MODEL, messages=HI, extra_body={"chat_template_kwargs": NO_THINK})
    assert counted.input_tokens == whole.usage.input_tokens


def test_system_prompt_and_stop_sequences(server: Server, client: anthropic.Anthropic) -> None:
    system = [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1; cch=abc;"},
              {"type": "text", "text": "Be brief."}]
    for stream in (False, True):
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 50, "messages": HI, "system": system,
                                "stop_sequences": ["STOP", "END"], "extra_body": forced("abc STOP def")}
        if stream:
            with client.messages.stream(**body) as s:
                msg = s.get_final_message()
        else:
            msg = client.messages.create(**body)
        assert msg.content[0].text == "abc " and (msg.stop_reason, msg.stop_sequence) == ("stop_sequence", "STOP")
    # the billing header block is left out of the prompt (vLLM's rule: it would defeat prefix caching)
    assert msg.usage.input_tokens == chat_prompt_tokens(server, [{"role": "system", "content": "Be brief."}, *HI],
                                                        chat_template_kwargs=NO_THINK)
    plain = client.messages.create(model=MODEL, max_tokens=50, messages=HI, system="Be brief.", extra_body=forced("ok"))
    assert plain.stop_reason == "end_turn" and plain.content[0].text == "ok"


def test_max_tokens_capped_at_the_context_window(client: anthropic.Anthropic) -> None:
    long = [{"role": "user", "content": "word " * 620}]
    msg = client.messages.create(model=MODEL, max_tokens=32000, messages=long, extra_body=FIXED)
    assert msg.stop_reason == "model_context_window_exceeded"
    assert msg.usage.input_tokens + msg.usage.output_tokens == 2048


def test_forced_tool_gives_a_valid_tool_use(server: Server, client: anthropic.Anthropic) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 200, "messages": HI, "tools": TOOLS,
                            "tool_choice": {"type": "tool", "name": "get_weather"}}
    for seed in (1, 2):
        msg = client.messages.create(**body, extra_body={"seed": seed, "chat_template_kwargs": NO_THINK})
        assert msg.stop_reason == "tool_use" and [b.type for b in msg.content] == ["tool_use"], msg
        call = msg.content[0]
        assert call.name == "get_weather" and call.id.startswith("toolu_")
        jsonschema.validate(call.input, WEATHER)
        events = raw_stream(server, {**body, "seed": seed, "chat_template_kwargs": NO_THINK})
        blocks = check_order(events)
        assert [b["type"] for b in blocks] == ["tool_use"] and blocks[0]["input"] == {}
        assert json.loads(blocks[0]["partial_json"]) == call.input and blocks[0]["name"] == "get_weather"
        assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    anyone = client.messages.create(**{**body, "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
                                    extra_body={"seed": 3, "chat_template_kwargs": NO_THINK})
    assert anyone.stop_reason == "tool_use" and [b.type for b in anyone.content] == ["tool_use"]
    assert anyone.content[0].name in ("get_weather", "get_time")


def test_auto_tool_call_and_text_before_it(client: anthropic.Anthropic) -> None:
    """"auto" (the default with tools): the server's hermes parser reads the model's calls."""
    text = 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    msg = client.messages.create(model=MODEL, max_tokens=200, messages=HI, tools=TOOLS, extra_body=forced(text))
    assert [b.type for b in msg.content] == ["text", "tool_use"] and msg.stop_reason == "tool_use"
    assert msg.content[0].text.strip() == "Let me look." and msg.content[1].input == {"zone": "UTC"}


def test_tool_result_turn_renders(server: Server, client: anthropic.Anthropic, tiny_model_dir: str) -> None:
    from transformers import AutoTokenizer

    history: list[dict[str, Any]] = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris", "days": 2}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"},
                                     {"type": "text", "text": "And tomorrow?"}]}]
    msg = client.messages.create(model=MODEL, max_tokens=1, messages=history, tools=TOOLS,  # type: ignore[arg-type]
                                 extra_body={"chat_template_kwargs": NO_THINK})
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    chat_tools = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                    "parameters": t["input_schema"]}} for t in TOOLS]
    as_template_sees = [history[0], {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "toolu_1", "type": "function", "function": {"name": "get_weather",
                                                           "arguments": {"city": "Paris", "days": 2}}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21 C"},
        {"role": "user", "content": "And tomorrow?"}]
    text = tok.apply_chat_template(as_template_sees, tools=chat_tools, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"name": "get_weather"' in text
    assert msg.usage.input_tokens == len(tok.encode(text, add_special_tokens=False))
    counted = client.messages.count_tokens(model=MODEL, messages=history, tools=TOOLS,  # type: ignore[arg-type]
                                           extra_body={"chat_template_kwargs": NO_THINK})
    assert counted.input_tokens == msg.usage.input_tokens


def test_thinking_blocks(server: Server, client: anthropic.Anthropic) -> None:
    body = {"model": MODEL, "max_tokens": 100, "messages": HI,
            "structured_outputs": {"regex": "<think>[xyz]{3,12}</think>[abc]{1,8}"}, "seed": 4}
    msg = client.messages.create(model=MODEL, max_tokens=100, messages=HI, extra_body={k: body[k] for k in
                                                                                        ("structured_outputs", "seed")})
    assert [b.type for b in msg.content] == ["thinking", "text"], msg.content
    assert re.fullmatch("[xyz]{3,12}", msg.content[0].thinking) and msg.content[0].signature
    assert re.fullmatch("[abc]{1,8}", msg.content[1].text)
    blocks = check_order(raw_stream(server, body))
    assert [b["type"] for b in blocks] == ["thinking", "text"] and blocks[0]["signature"]
    assert (blocks[0]["thinking"], blocks[1]["text"]) == (msg.content[0].thinking, msg.content[1].text)
    # the thinking block sent back (signature and all) renders as the template's reasoning
    again = client.messages.create(model=MODEL, max_tokens=1, messages=[*HI, {"role": "assistant", "content": [
        b.to_dict() for b in msg.content]}, {"role": "user", "content": "More."}])  # type: ignore[misc]
    assert again.usage.input_tokens > msg.usage.input_tokens


def test_api_keys(server: Server) -> None:
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, api_key=None, max_retries=0)
    assert bearer.messages.create(model=MODEL, max_tokens=1, messages=HI).usage.output_tokens == 1  # type: ignore[arg-type]
    wrong = anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        wrong.messages.create(model=MODEL, max_tokens=1, messages=HI)  # type: ignore[arg-type]
    assert err.value.status_code == 401 and err.value.body["type"] == "error"  # type: ignore[index]
    assert err.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    status, body = post_json(server.url + "/v1/chat/completions", {"messages": HI, "max_tokens": 1},
                             {"x-api-key": KEY})
    assert status == 200, body  # x-api-key on the OpenAI routes too
    status, body = post_json(server.url + "/v1/chat/completions", {"messages": HI, "max_tokens": 1},
                             {"x-api-key": "wrong"})
    assert status == 401 and body["error"]["code"] == 401  # OpenAI's shape there


@pytest.mark.parametrize(("body", "words"), [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "x"}}]}]},
     "'image'"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search_20250305"),
    ({"container": "c1"}, "container"),
    ({"mcp_servers": [{"type": "url", "url": "u", "name": "n"}]}, "mcp_servers"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "nope"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "n", "input": {}}]}]},
     "tool_use"),
    ({"messages": [{"role": "narrator", "content": "Hm."}]}, "narrator"),
])
def test_refused_fields(client: anthropic.Anthropic, body: dict[str, Any], words: str) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:  # extra_body: fields the client's signature lacks
        client.messages.create(model=MODEL, max_tokens=4, messages=HI, extra_body=body)  # type: ignore[arg-type]
    error = err.value.body
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert words in error["error"]["message"], error  # type: ignore[index]


def test_unknown_model_is_not_found(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as err:
        client.messages.create(model="claude-nope", max_tokens=1, messages=HI)  # type: ignore[arg-type]
    assert err.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]


def test_disconnect_aborts_the_stream(server: Server) -> None:
    before = server.metrics()["vllm:generation_tokens_total"]
    body = {"model": MODEL, "max_tokens": 1900, "messages": HI, "stream": True, **FIXED}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/messages", json=body,
                                                       headers={"x-api-key": KEY}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "event: content_block_delta":
                break
    wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 0, 30, "the abandoned request to end")
    assert server.metrics()["vllm:generation_tokens_total"] - before < 1900


def test_what_claude_code_sends_is_accepted(client: anthropic.Anthropic) -> None:
    """Fields Anthropic's clients send on every request, with no effect here, are not refused."""
    msg = client.messages.create(
        model=MODEL, max_tokens=3, metadata={"user_id": "u-1"}, service_tier="auto",
        thinking={"type": "enabled", "budget_tokens": 1024},
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]},
                  {"role": "assistant", "content": "Hel"}],  # a prefill: the reply continues it
        extra_body={**FIXED, "cache_control": {"type": "ephemeral"}, "temperature": 0.5, "top_p": 0.9, "top_k": 20})
    assert msg.usage.output_tokens == 3 and msg.stop_reason == "max_tokens"


def test_output_config_format_is_enforced(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    msg = client.messages.create(model=MODEL, max_tokens=100, messages=HI, output_config={
        "format": {"type": "json_schema", "schema": schema}, "effort": "low"}, extra_body={
        "seed": 2, "chat_template_kwargs": NO_THINK, "structured_outputs": {"disable_any_whitespace": True}})
    assert msg.stop_reason == "end_turn" and [b.type for b in msg.content] == ["text"]
    jsonschema.validate(json.loads(msg.content[0].text), schema)


def test_stop_strings_limit_names_stop_sequences(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.BadRequestError) as err:
        client.messages.create(model=MODEL, max_tokens=4, messages=HI, stop_sequences=list("abcdefgh"))
    assert err.value.body["error"]["message"].startswith("stop_sequences: ")  # type: ignore[index]


def test_block_builder() -> None:
    """Reasoning, text, whitespace between calls and two calls, as a reply parser emits them:
    three kinds of blocks, blank text opening none; with parallel false the second call is dropped."""
    from tidal.frontend.entrypoints.anthropic.protocol import ContentBlockStart, TextBlock, ToolUseBlock
    from tidal.frontend.entrypoints.anthropic.serving_messages import BlockBuilder
    from tidal.frontend.entrypoints.openai.reply import ContentDelta, ReasoningDelta, ToolArgsDelta, ToolCallStart

    events = [ReasoningDelta("hm"), ContentDelta("\n"), ContentDelta(" Sure"), ToolCallStart(0, "f"),
              ToolArgsDelta(0, '{"a": '), ToolArgsDelta(0, "1}"), ContentDelta("\n\n"), ToolCallStart(1, "g", "id9"),
              ToolArgsDelta(1, "{}")]
    builder = BlockBuilder()
    stream = builder.feed(events) + builder.close()
    assert [type(b).__name__ for b in builder.blocks] == ["ThinkingBlock", "TextBlock", "ToolUseBlock", "ToolUseBlock"]
    assert builder.blocks[1] == TextBlock("\n Sure") and builder.blocks[2].input == {"a": 1}  # type: ignore[union-attr]
    assert builder.blocks[3] == ToolUseBlock("id9", "g", {}) and builder.called
    assert [e.index for e in stream if isinstance(e, ContentBlockStart)] == [0, 1, 2, 3]
    single = BlockBuilder(parallel=False)
    single.feed(events)
    single.close()
    assert [type(b).__name__ for b in single.blocks] == ["ThinkingBlock", "TextBlock", "ToolUseBlock"]
