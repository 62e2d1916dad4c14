"""POST /v1/responses through the official `openai` client against one `tidal serve` (the tiny
Qwen3 model): streamed and whole responses alike, exact usage, a well-formed event sequence,
conversations by previous_response_id, store=false, text.format json_schema, function tools
with a forced tool_choice, and the 400s for what is not served."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import jsonschema
import msgspec
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from tests.server_utils import CHAT_TEMPLATE, Server, assert_openai_error, http_get, post_json, wait_for

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}
# A fixed length: the tiny model's weights are random, so it stops only where it is told to.
FIXED = {"ignore_eos": True, "seed": 11}


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, tidal_cache_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = str(tmp_path_factory.mktemp("tpl") / "chat.jinja")
    with open(template, "w") as f:  # a reasoning effort opens the thinking, as reasoning models' templates do
        f.write(CHAT_TEMPLATE + "{% if add_generation_prompt and reasoning_effort %}<think>\n{% endif %}")
    srv = Server(tiny_model_dir, ["--max-model-len", "2048", "--num-kv-blocks", "512", "--max-num-seqs", "8",
                                  "--chat-template", template, "--served-model-name", MODEL,
                                  "--reasoning-parser", "qwen3"], tidal_cache_dir)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return server.client()


def prompt_tokens(server: Server, messages: list[dict[str, Any]]) -> int:
    """The rendered chat prompt's token count, as the server's /tokenize has it."""
    status, body = post_json(server.url + "/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200, body
    return int(body["count"])


def collect(stream: Any) -> list[Any]:
    return [event for event in stream]


_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def strict(obj: Any) -> Any:
    """`obj` (what the client built, leniently) validated against the official type as it is."""
    return type(obj).model_validate(obj.to_dict(), strict=False)


def check_sequence(events: list[Any]) -> Any:
    """The stream's events are well formed (each one valid as the `openai` package types it);
    returns the final response object."""
    for e in events:
        strict(e)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete") and kinds.count(kinds[-1]) == 1
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    final = events[-1].response
    open_items: dict[int, Any] = {}
    texts: dict[tuple[int, int], str] = {}
    args: dict[int, str] = {}
    done_items: list[Any] = []
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert e.output_index == len(done_items) and not open_items  # one item open at a time, in order
            open_items[e.output_index] = e.item
        elif e.type == "response.output_item.done":
            assert e.item.id == open_items.pop(e.output_index).id
            done_items.append(e.item)
        elif e.type == "response.content_part.added":
            assert e.item_id == open_items[e.output_index].id
            texts[(e.output_index, e.content_index)] = ""
        elif e.type in ("response.output_text.delta", "response.reasoning_text.delta"):
            texts[(e.output_index, e.content_index)] += e.delta
        elif e.type in ("response.output_text.done", "response.reasoning_text.done"):
            assert texts[(e.output_index, e.content_index)] == e.text  # the deltas join to the done text
        elif e.type == "response.function_call_arguments.delta":
            args[e.output_index] = args.get(e.output_index, "") + e.delta
        elif e.type == "response.function_call_arguments.done":
            assert args.get(e.output_index, "") == e.arguments
    assert not open_items
    assert [i.id for i in final.output] == [i.id for i in done_items]
    return final


def test_streamed_equals_whole_with_exact_usage(server: Server, client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=9,
                                  temperature=1.0, extra_body=FIXED)
    whole = client.responses.create(**kwargs)
    events = collect(client.responses.create(stream=True, **kwargs))
    final = check_sequence(events)
    expected_in = prompt_tokens(server, [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Say hello."}])
    for r in (whole, final):
        strict(r)
        assert r.object == "response" and r.model == MODEL and r.id.startswith("resp_")
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.input_tokens == expected_in and r.usage.output_tokens == 9
        assert r.usage.total_tokens == expected_in + 9 and r.usage.output_tokens_details.reasoning_tokens == 0
        assert [i.type for i in r.output] == ["message"] and r.output[0].status == "incomplete"
    assert events[-1].type == "response.incomplete"
    assert final.output_text == whole.output_text and whole.output_text
    assert [e.type for e in events[2:5]] == ["response.output_item.added", "response.content_part.added",
                                            "response.output_text.delta"]
    assert [e.type for e in events[-4:-1]] == ["response.output_text.done", "response.content_part.done",
                                              "response.output_item.done"]
    assert whole.temperature == 1.0 and whole.max_output_tokens == 9 and whole.instructions == "Be brief."


def test_reasoning_item(server: Server, client: openai.OpenAI) -> None:
    """A reply inside the thinking the template opened is a reasoning item, streamed as
    reasoning_text events; usage counts its tokens."""
    kwargs: dict[str, Any] = dict(model=MODEL, input="Think.", reasoning={"effort": "low"}, max_output_tokens=8,
                                  extra_body=FIXED)
    whole = client.responses.create(**kwargs)
    events = collect(client.responses.create(stream=True, **kwargs))
    final = check_sequence(events)
    assert "response.reasoning_text.delta" in {e.type for e in events}
    for r in (whole, final):
        assert [i.type for i in r.output] == ["reasoning"] and r.output[0].content[0].text
        text = r.output[0].content[0].text
        status, body = post_json(server.url + "/tokenize", {"model": MODEL, "prompt": text,
                                                            "add_special_tokens": False})
        assert r.usage.output_tokens_details.reasoning_tokens == body["count"] > 0
        assert r.reasoning.effort == "low" and r.usage.output_tokens == 8
    assert final.output[0].content[0].text == whole.output[0].content[0].text


def test_previous_response_id_continues_and_get(server: Server, client: openai.OpenAI) -> None:
    first = client.responses.create(model=MODEL, input="Hi there.", instructions="Be brief.", max_output_tokens=6,
                                    extra_body=FIXED)
    second = client.responses.create(model=MODEL, input=[{"role": "user", "content": "And again?"}],
                                     previous_response_id=first.id, max_output_tokens=4, extra_body=FIXED)
    # The earlier turn, its reply included; its instructions are not carried over (OpenAI's rule).
    history = [{"role": "user", "content": "Hi there."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "And again?"}]
    assert second.usage.input_tokens == prompt_tokens(server, history)
    assert second.previous_response_id == first.id
    third = client.responses.create(model=MODEL, input="Last.", previous_response_id=second.id, max_output_tokens=3,
                                    extra_body=FIXED)
    history += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Last."}]
    assert third.usage.input_tokens == prompt_tokens(server, history)
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage


def test_store_false_and_unknown_ids(server: Server, client: openai.OpenAI) -> None:
    unstored = client.responses.create(model=MODEL, input="Hi.", store=False, max_output_tokens=2, extra_body=FIXED)
    assert unstored.store is False
    status, body = http_get(f"{server.url}/v1/responses/{unstored.id}")
    assert_openai_error(status, json.loads(body), 404)
    with pytest.raises(openai.NotFoundError) as err:
        client.responses.create(model=MODEL, input="More.", previous_response_id=unstored.id, max_output_tokens=2)
    assert unstored.id in err.value.message and err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")
    stored = client.responses.create(model=MODEL, input="Hi.", max_output_tokens=2, extra_body=FIXED)
    status, answer = post_json(f"{server.url}/v1/responses/{stored.id}/cancel", {})
    assert_openai_error(status, answer, 400)  # only background responses can be cancelled
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


def test_text_format_json_schema(client: openai.OpenAI) -> None:
    fmt = {"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA, "strict": True}}
    whole = client.responses.create(model=MODEL, input="Is it ok?", text=fmt, max_output_tokens=40)
    assert whole.status == "completed"  # the grammar ends the reply
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    with client.responses.stream(model=MODEL, input="Is it ok?", text=fmt, max_output_tokens=40) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text
    jsonschema.validate(json.loads(final.output_text), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_tool_forced_choice(client: openai.OpenAI, choice: Any) -> None:
    # A random model pads JSON with whitespace (up to the grammar's bound): room for it.
    kwargs: dict[str, Any] = dict(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice=choice,
                                  max_output_tokens=600, extra_body={"seed": 5})
    whole = client.responses.create(**kwargs)
    calls = [i for i in whole.output if i.type == "function_call"]
    assert calls and whole.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    events = collect(client.responses.create(stream=True, **kwargs))
    final = check_sequence(events)
    streamed = [i for i in final.output if i.type == "function_call"]
    assert [(c.name, c.arguments) for c in streamed] == [(c.name, c.arguments) for c in calls]
    # The tool loop: the call and its output go back as input items.
    call = calls[0]
    loop = client.responses.create(model=MODEL, max_output_tokens=3, extra_body=FIXED, input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny."}])
    assert loop.status == "incomplete" and loop.usage.output_tokens == 3


@pytest.mark.parametrize(("body", "param"), [
    ({"background": True}, "background"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"tool_choice": {"type": "web_search_preview"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text"),
    ({"max_output_tokens": 100000}, "max_output_tokens"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"input": [{"role": "user", "content": "Hi."}, {"role": "narrator", "content": "Hm."}]}, "input"),
])
def test_refused_fields(server: Server, body: dict[str, Any], param: str) -> None:
    status, answer = post_json(server.url + "/v1/responses", {"model": MODEL, "input": "Hi.", **body})
    assert_openai_error(status, answer, 400)
    assert answer["error"]["param"] == param, answer


def test_disconnect_aborts_the_stream(server: Server) -> None:
    """A client that leaves mid-stream ends its request in the engine (as chat's streams do):
    the core goes idle having made far fewer than the 2000 tokens asked for."""
    import httpx

    before = server.metrics()["vllm:generation_tokens_total"]
    body = {"model": MODEL, "input": "Go on.", "stream": True, "max_output_tokens": 2000, **FIXED}
    with httpx.Client(timeout=60) as http, http.stream("POST", server.url + "/v1/responses", json=body) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line == "event: response.output_text.delta":
                break
    wait_for(lambda: server.metrics()["vllm:num_requests_running"] == 0, 30, "the abandoned request to end")
    assert server.metrics()["vllm:generation_tokens_total"] - before < 2000


def test_output_builder_items_and_events() -> None:
    """Reasoning, text and two tool calls, as a reply parser emits them, become three kinds of
    items whose events (each valid as the `openai` package types it) spell them."""
    from tidal.frontend.entrypoints.openai.reply import ContentDelta, ReasoningDelta, ToolArgsDelta, ToolCallStart
    from tidal.frontend.entrypoints.openai.responses_protocol import (
        ResponseCompleted, ResponseCreated, ResponseInProgress, ResponsesResponse)
    from tidal.frontend.entrypoints.openai.serving_responses import OutputBuilder

    builder = OutputBuilder()
    events = builder.feed([ReasoningDelta("think"), ReasoningDelta("ing")])
    events += builder.feed([ContentDelta("Hel"), ContentDelta("lo"), ToolCallStart(0, "get_weather", "abc123xyz")])
    events += builder.feed([ToolArgsDelta(0, '{"city": '), ToolArgsDelta(0, '"Rome"}'), ToolCallStart(1, "f")])
    events += builder.close("completed")
    opening = ResponsesResponse(id="resp_1", created_at=0, status="in_progress", model=MODEL)
    final = ResponsesResponse(id="resp_1", created_at=0, status="completed", model=MODEL, output=builder.items)
    wire = [ResponseCreated(response=opening), ResponseInProgress(response=opening), *events,
            ResponseCompleted(response=final)]
    for n, e in enumerate(wire):
        e.sequence_number = n
    parsed = [_EVENT.validate_json(msgspec.json.encode(e)) for e in wire]
    done = check_sequence(parsed)
    assert [i.type for i in done.output] == ["reasoning", "message", "function_call", "function_call"]
    assert done.output[0].content[0].text == "thinking" and done.output[1].content[0].text == "Hello"
    assert (done.output[2].name, done.output[2].arguments, done.output[2].call_id) == (
        "get_weather", '{"city": "Rome"}', "abc123xyz")
    assert done.output[3].arguments == "" and done.output[3].call_id.startswith("call_")
    assert "".join(builder.reasoning) == "thinking"
    Response.model_validate_json(msgspec.json.encode(final))
    single = OutputBuilder(parallel=False)  # parallel_tool_calls false: the first call only
    single.feed([ToolCallStart(0, "f"), ToolArgsDelta(0, "{}"), ToolCallStart(1, "g"), ToolArgsDelta(1, "{}")])
    single.close("completed")
    assert [(i.name, i.arguments) for i in single.items] == [("f", "{}")]  # type: ignore[union-attr]


def test_chat_request_mapping() -> None:
    """What a Responses request becomes for the chat route: flattened tools and a named
    tool_choice in chat's shapes, text.format as response_format (compact JSON, vLLM's options),
    truncation "auto" as a prompt truncation leaving room for the output, vLLM's extras passed."""
    from tidal.frontend.entrypoints.openai.protocol import request_decoder
    from tidal.frontend.entrypoints.openai.responses_input import chat_request, items_to_messages
    from tidal.frontend.entrypoints.openai.responses_protocol import ResponsesRequest

    req = request_decoder(ResponsesRequest).decode(json.dumps({
        "input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}}, "truncation": "auto",
        "max_output_tokens": 16, "reasoning": {"effort": "low"}, "seed": 3, "top_k": 5, "stream": True}))
    chat = chat_request(req, [{"role": "user", "content": "Hi"}], 2048)
    assert chat.tools == [{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                    "parameters")}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.response_format is not None and chat.response_format.json_schema is not None
    assert chat.response_format.json_schema.json_schema == SCHEMA
    assert chat.structured_outputs is not None and chat.structured_outputs.disable_any_whitespace
    assert (chat.truncate_prompt_tokens, chat.max_completion_tokens, chat.reasoning_effort) == (2032, 16, "low")
    assert (chat.seed, chat.top_k, chat.stream) == (3, 5, True)
    messages = items_to_messages([
        {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me look."}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "reasoning", "id": "rs_1", "summary": []}])
    assert [m["role"] for m in messages] == ["system", "assistant", "tool"]
    assert [c["id"] for c in messages[1]["tool_calls"]] == ["c1", "c2"]  # one assistant turn: text and calls
