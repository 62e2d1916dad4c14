"""Tool calling and reasoning on `tidal serve` (issue 35), vLLM's behaviour as the spec: the
flags (--enable-auto-tool-choice, --tool-call-parser, --reasoning-parser), tool_choice "none",
"auto", "required" and named, parallel_tool_calls, OpenAI's response and stream shapes, tool
call history through the chat template, and the 400s.

The model is random, so "auto" replies are forced into the Hermes format with a regex
constraint (the user's own constraint applies under "auto"), and "required"/named replies are
held to the tools' schemas by the server's own constraint: each seeded reply of a batch must
validate (jsonschema). One server for the module, with both parsers."""
from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest

from tests.server_utils import Server, assert_openai_error, http_request, post_json
from tidal.frontend.entrypoints.openai.errors import APIError

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,8}$"},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
    "unit": {"enum": ["C", "F"]}}, "required": ["city", "days"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
         "additionalProperties": False}
PARAMS = {"get_weather": WEATHER, "get_time": CLOCK}
TOOLS = [{"type": "function", "function": {"name": name, "description": f"{name} of a place", "parameters": params}}
         for name, params in PARAMS.items()]
USER = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
NO_THINK = {"enable_thinking": False}  # the template closes the thinking: the reply is content
CALL_1 = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
CALL_2 = '{"name": "get_time", "arguments": {"zone": "UTC"}}'
HERMES = f"<tool_call>\n{CALL_1}\n</tool_call>\n<tool_call>\n{CALL_2}\n</tool_call>"


def forced(text: str) -> dict[str, Any]:
    """Body fields that make the model write exactly `text`."""
    return {"structured_outputs": {"regex": re.escape(text)}, "chat_template_kwargs": NO_THINK}


def named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str) -> Iterator[Server]:
    srv = Server(tiny_model_dir, ["--max-model-len", "2048", "--num-kv-blocks", "2048", "--served-model-name", "m",
                                  "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                                  "--reasoning-parser", "qwen3"], tidal_cache_dir)
    yield srv
    srv.stop()


def chat(server: Server, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
    status, out = post_json(server.url + "/v1/chat/completions", {"messages": USER, **body},
                            {"X-Request-Id": request_id} if request_id else None)
    assert status == 200, out
    return out


def stream(server: Server, body: dict[str, Any], request_id: str) -> list[dict[str, Any]]:
    status, raw = http_request("POST", server.url + "/v1/chat/completions",
                               json.dumps({"messages": USER, **body, "stream": True}).encode(),
                               {"X-Request-Id": request_id})
    assert status == 200, raw
    payloads = [p[6:] for p in raw.decode().split("\n\n") if p.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    return [json.loads(p) for p in payloads[:-1]]


def no_nulls(value: Any, where: str) -> None:
    """A delta sets fields or leaves them out; a null anywhere in one breaks strict clients."""
    assert value is not None, where
    if isinstance(value, dict):
        for k, v in value.items():
            no_nulls(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            no_nulls(v, f"{where}[{i}]")


def joined(chunks: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's streamed reply put together as a message, checking the delta rules on the
    way: the role in the first delta only, no nulls, a call's id/type/name in its first delta only."""
    out: dict[int, dict[str, Any]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            i, delta = choice["index"], choice["delta"]
            no_nulls(delta, f"choice {i} delta")
            if i not in out:
                assert delta == {"role": "assistant", "content": ""}, delta
                out[i] = {"content": None, "reasoning_content": None, "reasoning": None, "calls": {},
                          "finish_reason": None}
                continue
            msg = out[i]
            assert "role" not in delta and msg["finish_reason"] is None
            for key in ("content", "reasoning_content", "reasoning"):
                if key in delta:
                    msg[key] = (msg[key] or "") + delta[key]
            for call in delta.get("tool_calls", []):
                first = call["index"] not in msg["calls"]
                assert first == ("id" in call) == ("type" in call) == ("name" in call.get("function", {})), call
                if first:
                    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
                    msg["calls"][call["index"]] = {"id": call["id"], "type": "function",
                                                   "function": {"name": call["function"]["name"], "arguments": ""}}
                msg["calls"][call["index"]]["function"]["arguments"] += call["function"].get("arguments", "")
            msg["finish_reason"] = choice["finish_reason"]
    return out


def assert_stream_matches(server: Server, body: dict[str, Any], request_id: str) -> dict[str, Any]:
    """The same request (same X-Request-Id, seeded) streamed and not: equal replies, call ids too."""
    whole = chat(server, body, request_id)
    parts = joined(stream(server, body, request_id))
    assert sorted(parts) == [c["index"] for c in whole["choices"]]
    for c in whole["choices"]:
        msg, got = c["message"], parts[c["index"]]
        calls = [got["calls"][k] for k in sorted(got["calls"])]
        assert sorted(got["calls"]) == list(range(len(calls)))
        assert calls == msg["tool_calls"], (calls, msg["tool_calls"])
        content = got["content"] if got["content"] is not None or calls else ""
        assert (content, got["reasoning_content"], got["finish_reason"]) == (
            msg["content"], msg["reasoning_content"], c["finish_reason"])
        assert msg["reasoning"] == msg["reasoning_content"] and got["reasoning"] == got["reasoning_content"]
    return whole


def test_auto_parses_the_models_calls(server: Server) -> None:
    client = server.client()
    resp = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=200, n=2, seed=1,
                                          extra_body=forced(HERMES))
    ids = []
    for choice in resp.choices:
        msg = choice.message
        assert msg.content is None and choice.finish_reason == "tool_calls"
        assert [(c.type, c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
            ("function", "get_weather", {"city": "Paris", "days": 3}), ("function", "get_time", {"zone": "UTC"})]
        ids += [c.id for c in msg.tool_calls]
    assert len(set(ids)) == 4 and all(i.startswith("chatcmpl-tool-") for i in ids)
    # parallel_tool_calls false: the first call only
    one = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=200,
                                         parallel_tool_calls=False, extra_body=forced(HERMES)).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_weather"] and one.finish_reason == "tool_calls"
    # text before a call is content; tool_choice "none" parses nothing
    mixed = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=200,
                                           extra_body=forced("Sure. " + HERMES)).choices[0].message
    assert mixed.content == "Sure. " and len(mixed.tool_calls) == 2
    plain = client.chat.completions.create(model="m", messages=USER, tools=TOOLS, tool_choice="none", max_tokens=200,
                                           extra_body=forced(HERMES)).choices[0]
    assert plain.message.content == HERMES and not plain.message.tool_calls and plain.finish_reason == "stop"
    # cut by max_tokens: "length", whatever was parsed
    assert client.chat.completions.create(model="m", messages=USER, tools=TOOLS, max_tokens=4,
                                          extra_body=forced(HERMES)).choices[0].finish_reason == "length"


def test_streamed_replies_equal_whole_ones(server: Server) -> None:
    auto = {"tools": TOOLS, "max_tokens": 200, "seed": 7, **forced("Sure. " + HERMES)}
    whole = assert_stream_matches(server, auto, "same-auto")
    assert whole["choices"][0]["message"]["tool_calls"][0]["id"] == chat(server, auto, "same-auto")[
        "choices"][0]["message"]["tool_calls"][0]["id"]  # a pure function of the request id
    assert whole["choices"][0]["message"]["tool_calls"][0]["id"] != chat(server, auto, "other")[
        "choices"][0]["message"]["tool_calls"][0]["id"]
    base = {"tools": TOOLS, "max_tokens": 300, "seed": 11, "n": 2, "chat_template_kwargs": NO_THINK}
    assert_stream_matches(server, {**base, "tool_choice": "required"}, "same-required")
    assert_stream_matches(server, {**base, "tool_choice": named("get_weather")}, "same-named")
    think = {"max_tokens": 100, "seed": 3, "n": 2,
             "structured_outputs": {"regex": "<think>[xyz]{3,12}</think>[abc ]{1,8}"}}
    assert_stream_matches(server, think, "same-think")


def test_forced_choices_give_schema_valid_arguments(server: Server) -> None:
    """50 seeded requests at once: "required" (several calls, or one with parallel_tool_calls
    false) and named choices; every call is a tool's, with arguments valid for its schema."""
    client = server.async_client()
    cases: list[tuple[Any, bool]] = ([("required", True)] * 20 + [("required", False)] * 10
                                     + [(named("get_weather"), True)] * 10 + [(named("get_time"), True)] * 10)

    async def one(seed: int, choice: Any, parallel: bool) -> Any:
        # A random model pads JSON with all the whitespace the grammar allows: the requests
        # that may make several calls ask for none (the user's structured-output options
        # still apply to the server's constraint), so their arrays end within max_tokens.
        extra: dict[str, Any] = {"chat_template_kwargs": NO_THINK}
        if choice == "required" and parallel:
            extra["structured_outputs"] = {"disable_any_whitespace": True}
        return await client.chat.completions.create(
            model="m", messages=USER, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel, seed=seed,
            temperature=1.0, max_tokens=600, extra_body=extra)

    async def run() -> list[Any]:
        return await asyncio.gather(*(one(seed, c, p) for seed, (c, p) in enumerate(cases)))

    for (choice, parallel), resp in zip(cases, asyncio.run(run())):
        c = resp.choices[0]
        assert c.message.content is None and c.message.tool_calls, c
        assert c.finish_reason == ("tool_calls" if choice == "required" else "stop"), c  # OpenAI's, as vLLM's
        if not parallel or choice != "required":
            assert len(c.message.tool_calls) == 1
        for call in c.message.tool_calls:
            if choice != "required":
                assert call.function.name == choice["function"]["name"]
            jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_reasoning_never_reaches_the_content(server: Server) -> None:
    body = {"max_tokens": 100, "seed": 5, "n": 3,
            "structured_outputs": {"regex": "<think>[xyz]{3,12}</think>[abc]{1,8}"}}
    for resp in (chat(server, body, "think"), {"choices": [
            {"index": i, "message": m} for i, m in joined(stream(server, body, "think")).items()]}):
        for c in resp["choices"]:
            msg = c["message"]
            assert re.fullmatch("[abc]{1,8}", msg["content"]) and re.fullmatch("[xyz]{3,12}", msg["reasoning_content"])
    hidden = chat(server, {**body, "include_reasoning": False}, "think")["choices"][0]["message"]
    assert hidden["reasoning_content"] is None and re.fullmatch("[abc]{1,8}", hidden["content"])


def test_tool_history_renders_through_the_chat_template(server: Server, tiny_model_dir: str) -> None:
    """An assistant turn's calls (arguments as OpenAI's JSON text, content null) and the tool's
    result reach the template as vLLM passes them: arguments as a dict."""
    from transformers import AutoTokenizer

    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather",
                                                             "arguments": '{"city": "Paris", "days": 2}'}}
    history = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"}]
    ids = chat(server, {"messages": history, "tools": TOOLS, "max_tokens": 1, "return_token_ids": True})[
        "prompt_token_ids"]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    as_template_sees = [*USER, {"role": "assistant", "content": "", "tool_calls": [
        {**call, "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}, history[2]]
    text = tok.apply_chat_template(as_template_sees, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text and '"name": "get_time"' in text
    assert ids == tok.encode(text, add_special_tokens=False)
    # tool_choice "none": the template still lists the tools
    none = chat(server, {"tools": TOOLS, "tool_choice": "none", "max_tokens": 1, "return_token_ids": True})
    assert len(none["prompt_token_ids"]) > len(chat(server, {"max_tokens": 1, "return_token_ids": True})[
        "prompt_token_ids"])


def test_langchain_tool_loop(server: Server) -> None:
    """LangChain's ChatOpenAI with bound tools: the model calls a tool, the result goes back as
    a ToolMessage, the model answers."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model="m", base_url=server.url + "/v1", api_key="none", max_retries=0, max_tokens=200,
                     temperature=1.0).bind_tools([TOOLS[0]])
    messages: list[Any] = [HumanMessage(USER[0]["content"])]
    ai = llm.invoke(messages, extra_body=forced(f"<tool_call>\n{CALL_1}\n</tool_call>"))
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris", "days": 3})]
    messages += [ai, ToolMessage("sunny, 21 C", tool_call_id=ai.tool_calls[0]["id"])]
    answer = llm.invoke(messages, extra_body=forced("It is sunny in Paris."))
    assert answer.content == "It is sunny in Paris." and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] == "stop"


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "auto"}, "tool_choice", "When using `tool_choice`, `tools` must be set."),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "Invalid value for `tool_choice`: sometimes!"),
    ({"tools": TOOLS, "tool_choice": named("get_mood")}, "tool_choice", "Tool 'get_mood' has not been passed"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}}, "tool_choice", "Expected field `name`"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "either use constraints for structured outputs or tools, not both"),
    ({"tools": TOOLS, "tool_choice": named("get_time"), "structured_outputs": {"regex": "a+"}}, "tool_choice",
     "not both"),
    ({"tools": [{"type": "function"}]}, "tools", "tools[0]: expected"),
    ({"tools": TOOLS, "messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{zone"}}]}]},
     "messages", "messages[1].tool_calls[0].function.arguments is not valid JSON"),
])
def test_refused_combinations(server: Server, body: dict[str, Any], param: str, words: str) -> None:
    status, err = post_json(server.url + "/v1/chat/completions", {"messages": USER, "max_tokens": 1, **body})
    assert_openai_error(status, err, 400)
    assert err["error"]["param"] == param and words in err["error"]["message"], err


def test_auto_needs_the_server_flags_and_none_may_hide_the_tools() -> None:
    from tidal.frontend.entrypoints.openai.chat_tools import AUTO_NEEDS_FLAGS, tool_plan
    from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest
    from tidal.frontend.entrypoints.openai.serving_context import ChatOptions

    req = ChatCompletionRequest(messages=USER, tools=TOOLS)  # no tool_choice: "auto"
    for options in (ChatOptions(), ChatOptions(tool_call_parser="hermes")):
        with pytest.raises(APIError) as e:
            tool_plan(req, options)
        assert e.value.status == 400 and str(e.value.args[0]) == AUTO_NEEDS_FLAGS
    assert tool_plan(req, ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")).choice == "auto"
    none = ChatCompletionRequest(messages=USER, tools=TOOLS, tool_choice="none")
    assert tool_plan(none, ChatOptions()).template_tools is not None
    assert tool_plan(none, ChatOptions(exclude_tools_when_tool_choice_none=True)).template_tools is None
    empty = ChatCompletionRequest(messages=USER, tools=[], tool_choice="required")  # OpenAI's: as "none"
    assert tool_plan(empty, ChatOptions()).choice == "none"


def test_forced_choice_schemas_are_vllms() -> None:
    from tidal.frontend.entrypoints.openai.chat_tools import checked_tools, tool_schema

    ref = {"type": "object", "properties": {"at": {"$ref": "#/$defs/place"}}, "$defs": {"place": {"type": "string"}}}
    tools = checked_tools([*TOOLS, {"type": "function", "function": {"name": "ping"}},
                           {"type": "function", "function": {"name": "go", "parameters": ref}}])
    schema = tool_schema(tools, None, parallel=False)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["$defs"] == {"place": {"type": "string"}} and "$defs" in ref  # hoisted from a copy
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"] for b in branches] == [{"type": "string", "enum": [n]} for n in
                                                          ("get_weather", "get_time", "ping", "go")]
    assert branches[2]["properties"]["parameters"] == {"type": "object", "properties": {}}
    jsonschema.validate([{"name": "go", "parameters": {"at": "x"}}], schema)
    assert tool_schema(tools, "get_time") == CLOCK and "maxItems" not in tool_schema(tools, None)


def test_parser_flags_checked_at_start_up() -> None:
    from tidal.frontend.entrypoints.cli import build_parser
    from tidal.frontend.entrypoints.openai.server_flags import check_server_flags

    def check(*flags: str) -> None:
        check_server_flags(build_parser().parse_args(["serve", "m", *flags]))

    check("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3",
          "--exclude-tools-when-tool-choice-none")
    with pytest.raises(ValueError, match="^--enable-auto-tool-choice requires --tool-call-parser$"):
        check("--enable-auto-tool-choice")
    with pytest.raises(ValueError, match=r"invalid tool call parser: nope \(chose from \{ .*hermes.* \}\)"):
        check("--tool-call-parser", "nope")
    with pytest.raises(ValueError, match=r"invalid reasoning parser: nope \(chose from \{ .*qwen3.* \}\)"):
        check("--reasoning-parser", "nope")


def test_chat_template_is_chatml_without_tools(tiny_model_dir: str) -> None:
    """make_model's template (transformers renders it): plain messages exactly as the plain
    ChatML template renders them; tools, calls and results in Qwen3's Hermes format."""
    from transformers import AutoTokenizer
    from tidal.frontend.entrypoints.make_model import CHATML_TEMPLATE

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    convos = [USER, [{"role": "system", "content": "Be brief."}, *USER, {"role": "assistant", "content": "Hi."},
                     {"role": "user", "content": ""}], [{"role": "developer", "content": "x"}]]
    for messages in convos:
        for gen in (True, False):
            assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen) == \
                tok.apply_chat_template(messages, chat_template=CHATML_TEMPLATE, tokenize=False,
                                        add_generation_prompt=gen)
    system = [{"role": "system", "content": "Be brief."}, *USER]
    text = tok.apply_chat_template(system, tools=TOOLS[:1], tokenize=False, add_generation_prompt=True,
                                   enable_thinking=False)
    assert text == ("<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with "
                    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
                    f"<tools>\n{json.dumps(TOOLS[0])}\n</tools>\n\nFor each function call, return a json object with "
                    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
                    f"<|im_start|>user\n{USER[0]['content']}<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    thought = [*USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look it up."}]
    assert tok.apply_chat_template(thought, tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\nSunny.<|im_end|>\n")
