"""The tool-call parsers (issue 35 item 2): each reference reply, fed whole, per character, per
token of a real byte-level tokenizer and in random chunks, spells the same Reply, and that Reply
is the hand-written one (names, arguments as JSON, ids, content). Events keep reply.py's
invariants. Pure Python: no model, no torch."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Callable, Union

import pytest
from tokenizers import Tokenizer

from parser_utils import byte_bpe_tokenizer, run, splits

from tidal.frontend.entrypoints.openai.reply import (
    ContentDelta, ReasoningDelta, Reply, ReplyEvent, ReplyParser, ToolArgsDelta, ToolCall, ToolCallStart, ToolParser,
    collect)
from tidal.frontend.entrypoints.openai.tool_parsers import (
    HermesToolParser, Llama3JsonToolParser, MistralToolParser, NamedToolParser, PythonicToolParser,
    RequiredToolsParser, ToolParserManager)
from tidal.frontend.entrypoints.openai.tool_parsers.json_scan import END, ERROR, MORE, JsonValueScanner

# Arguments with what breaks naive scanners: `}` `"` `\` inside strings, nesting, unicode.
W: dict[str, Any] = {"city": 'Paris "}" ok \\ é', "days": [1, {"a": None}], "metric": True,  # markers too
                     "note": "日本 ✓ {[", "path": "C:\\dir\\", "tags": "</tool_call> [TOOL_CALLS] <|python_tag|>"}
WJ = json.dumps(W, ensure_ascii=False)  # as a model writes it
WJ_PRETTY = json.dumps(W, ensure_ascii=False, indent=2)
GEN = "<generated>"  # a Mistral id the parser made (checked: 9 alphanumerics)
Args = Union[dict[str, Any], str]  # a dict: json.loads(arguments) equals it; a str: arguments is exactly it
Call = tuple[str, Args, Union[str, None]]
QWEN = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'.format

# (parser, reply text, expected content, expected calls)
CASES: list[tuple[str, str, str | None, list[Call]]] = [
    ("hermes", "Just text, no call.\n", "Just text, no call.\n", []),
    ("hermes", "\n", "\n", []),
    ("hermes", QWEN("get_weather", WJ), None, [("get_weather", W, None)]),
    ("hermes", QWEN("get_weather", WJ_PRETTY) + "\n\n", None, [("get_weather", W, None)]),
    ("hermes", "Let me look.\n\n" + QWEN("a", '{"x": 1}') + "\n" + '<tool_call>\n{"arguments": {}, "name": "b"}\n'
     "</tool_call>\nDone.", "Let me look.\n\nDone.", [("a", {"x": 1}, None), ("b", {}, None)]),
    ("hermes", "天気を調べます。" + QWEN("w", '{"q": "東京"}'), "天気を調べます。", [("w", {"q": "東京"}, None)]),
    ("hermes", '<tool_call>{"name": "a", "arguments": {}}\n<tool_call>{"name": "b", "arguments": {"k": "v"}}',
     None, [("a", {}, None), ("b", {"k": "v"}, None)]),  # end tags missing
    ("hermes", '<tool_call>{"name": "ping"}</tool_call>', None, [("ping", {}, None)]),
    # vLLM's streaming bugs: closing braces lost after numbers/booleans/nesting (#22885, #32152), a
    # string partial_json_parser chokes on (#21544)
    ("hermes", QWEN("run", '{"cmd": "mkdir -p test/{test1,test2", "o": {"b": [1, {"c": true}]}, "n": 5}'), None,
     [("run", {"cmd": "mkdir -p test/{test1,test2", "o": {"b": [1, {"c": True}]}, "n": 5}, None)]),
    ("hermes", "Ends with a marker-like <tool_", "Ends with a marker-like <tool_", []),
    ("hermes", "A <tool_call> that is prose, </tool_call> too.", "A <tool_call> that is prose, </tool_call> too.",
     []),
    ("hermes", '<tool_call>{"foo": 1}</tool_call> x', '<tool_call>{"foo": 1}</tool_call> x', []),
    ("hermes", '<tool_call>\n{"name": 3, "arguments": {}}</tool_call>',
     '<tool_call>\n{"name": 3, "arguments": {}}</tool_call>', []),
    ("hermes", '<tool_call>\n{"name": "get_we', '<tool_call>\n{"name": "get_we', []),  # cut off before the name
    ("hermes", 'Checking.\n<tool_call>\n{"name": "f", "arguments": {"a": [1, "}', "Checking.\n",
     [("f", '{"a": [1, "}', None)]),  # cut off mid-arguments (max_tokens)
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1 ]}}</tool_call>after', "after",
     [("f", '{"a": 1 ', None)]),  # broken after its start: the call stands, its tags' rest is dropped
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WJ}}}', None, [("get_weather", W, None)]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"q": "x;y"}}; {"name": "b", "arguments": {}}', None,
     [("a", {"q": "x;y"}, None), ("b", {}, None)]),
    ("llama3_json", '{"type": "function", "name": "search", "parameters": {"query": "vLLM \\"tools\\""}}', None,
     [("search", {"query": 'vLLM "tools"'}, None)]),
    ("llama3_json", f'\n{{"parameters": {WJ_PRETTY}, "name": "late"}}', None, [("late", W, None)]),
    ("llama3_json", '{"name": "a", "parameters": {}}\n\nand then text', "and then text", [("a", {}, None)]),
    ("llama3_json", "Hello! How can I help?", "Hello! How can I help?", []),
    ("llama3_json", "The answer is {not a call}.", "The answer is {not a call}.", []),
    ("llama3_json", '  {"answer": 42}', '  {"answer": 42}', []),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")', '<|python_tag|>brave_search.call(query="x")', []),
    ("llama3_json", "<|python_ta", "<|python_ta", []),
    ("llama3_json", '{"name": "f", "parameters": {"city": "Par', None, [("f", '{"city": "Par', None)]),
    ("mistral", f'Sure.[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WJ}}}, {{"name": "b", "arguments": {{}}, '
     '"id": "abcDEF123"}]', "Sure.", [("get_weather", W, GEN), ("b", {}, "abcDEF123")]),
    ("mistral", '[TOOL_CALLS][{"name": "x", "arguments": {"a": 1}, "id": "bad id"}]', None, [("x", {"a": 1}, GEN)]),
    ("mistral", f"[TOOL_CALLS]get_weather[ARGS]{WJ}[TOOL_CALLS]b[ARGS]{{}}", None,
     [("get_weather", W, GEN), ("b", {}, GEN)]),
    ("mistral", '[TOOL_CALLS]add[CALL_ID]a1B2c3D4e[ARGS]{"a": 3.5, "b": 4}', None,
     [("add", {"a": 3.5, "b": 4}, "a1B2c3D4e")]),
    ("mistral", '[TOOL_CALLS]f{"s": "[TOOL_CALLS]"}\n\nDone.', "Done.", [("f", {"s": "[TOOL_CALLS]"}, GEN)]),
    ("mistral", "[TOOL_CALLS]f[ARGS]not json[TOOL_CALLS]g[ARGS]{}", None, [("f", "not json", GEN), ("g", {}, GEN)]),
    ("mistral", '[TOOL_CALLS]f[ARGS]{"a": "x', None, [("f", '{"a": "x', GEN)]),
    ("mistral", '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "argu', ', {"name": "b", "argu',
     [("a", {}, GEN)]),
    ("mistral", "Prose about [TOOL and [ARGS] only.", "Prose about [TOOL and [ARGS] only.", []),
    ("mistral", "x [TOOL_CALLS] hello there", "x [TOOL_CALLS] hello there", []),
    ("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", []),
    ("mistral", "[TOOL_CALLS][TOOL_CALLS]f[ARGS]{}", "[TOOL_CALLS]", [("f", {}, GEN)]),
    ("pythonic", "[get_weather(city='Paris \"}\" ok \\\\ é', days=[1, {'a': None}], metric=True, note='日本 ✓ {[', "
     "path='C:\\\\dir\\\\', tags='</tool_call> [TOOL_CALLS] <|python_tag|>'), noop()]", None,
     [("get_weather", W, None), ("noop", {}, None)]),
    ("pythonic", "\n[search(q=\"a]b)c\", opts={'deep': False, 'n': -2.5}, tags=[]),\n say(text='it\\'s')]", None,
     [("search", {"q": "a]b)c", "opts": {"deep": False, "n": -2.5}, "tags": []}, None),
      ("say", {"text": "it's"}, None)]),
    ("pythonic", "[f(x=1)]\nThat was it.", "That was it.", [("f", {"x": 1}, None)]),
    ("pythonic", "[f('SF', x=1)]", None, [("f", {"x": 1}, None)]),  # positional arguments ignored, as vLLM's
    ("pythonic", "No calls here.", "No calls here.", []),
    ("pythonic", "[1, 2, 3] is a list.", "[1, 2, 3] is a list.", []),
    ("pythonic", "[link](http://x) and more", "[link](http://x) and more", []),
    ("pythonic", "[f(x=1), g(y=foo)]", ", g(y=foo)]", [("f", {"x": 1}, None)]),  # not a literal
    ("pythonic", "[f(x=1), g(y='cut", ", g(y='cut", [("f", {"x": 1}, None)]),  # cut off
    ("pythonic", "[get_weather(city='S", "[get_weather(city='S", []),
]
IDS = [f"{i}-{p}-{t[:16]!r}" for i, (p, t, _, _) in enumerate(CASES)]
FORCED: list[tuple[Callable[[], ToolParser], str, str | None, list[Call]]] = [
    (RequiredToolsParser, f'[{{"name": "get_weather", "parameters": {WJ}}}, {{"parameters": {{}}, "name": "b"}}]',
     None, [("get_weather", W, None), ("b", {}, None)]),
    (RequiredToolsParser, f' [\n  {{"name": "f", "parameters": {WJ_PRETTY}}}\n]', None, [("f", W, None)]),
    (RequiredToolsParser, '[{"name": "f", "parameters": {"a": [1', None, [("f", '{"a": [1', None)]),
    (RequiredToolsParser, '[{"name": "f", "param', None, [("f", "", None)]),  # the name was complete: a call
    (RequiredToolsParser, '[{"na', '[{"na', []),
    (lambda: NamedToolParser([], "get_weather"), WJ, None, [("get_weather", W, None)]),
    (lambda: NamedToolParser([], "get_weather"), WJ_PRETTY[:40], None, [("get_weather", WJ_PRETTY[:40], None)]),
]


@pytest.fixture(scope="module")
def tokenizer(tidal_cache_dir: str) -> Iterator[Tokenizer]:
    """make_model's byte-level BPE: markers are several tokens, multi-byte characters split."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        yield byte_bpe_tokenizer()


def check_events(events: list[ReplyEvent]) -> None:
    """reply.py's invariants: calls start as 0, 1, 2... in order, a call's arguments come after
    its start and before the next call's; no delta is empty."""
    current = -1
    for e in events:
        if isinstance(e, (ContentDelta, ToolArgsDelta)):
            assert e.text, events
        if isinstance(e, ToolCallStart):
            assert e.index == current + 1, events
            current = e.index
        elif isinstance(e, ToolArgsDelta):
            assert e.index == current, events


def normalized(reply: Reply) -> Reply:
    """`reply` with the ids a parser generated (random) as GEN, after checking their shape."""
    calls = []
    for c in reply.tool_calls:
        cid = c.id
        if cid is not None and not cid.startswith("a1B2") and cid != "abcDEF123":
            assert len(cid) == 9 and cid.isascii() and cid.isalnum(), cid
            cid = GEN
        calls.append(ToolCall(c.index, c.name, c.arguments, cid))
    return Reply(reply.reasoning, reply.content, calls)


def check_reply(reply: Reply, text: str, content: str | None, expected: list[Call]) -> None:
    assert reply.reasoning is None and reply.content == content
    assert [(c.index, c.name, c.id) for c in reply.tool_calls] == [(i, n, d) for i, (n, _, d) in enumerate(expected)]
    for c, (_, args, _) in zip(reply.tool_calls, expected):
        if isinstance(args, str):
            assert c.arguments == args
        else:
            assert json.loads(c.arguments) == args


def check_all_splits(make: Callable[[], ToolParser], tok: Tokenizer, text: str, content: str | None,
                     expected: list[Call]) -> Reply:
    whole = normalized(collect(run(make(), [text])))
    check_reply(whole, text, content, expected)
    for how, pieces in splits(tok, text).items():
        events = run(make(), pieces)
        check_events(events)
        assert normalized(collect(events)) == whole, how
    return whole


@pytest.mark.parametrize("name,text,content,expected", CASES, ids=IDS)
def test_reference_replies(tokenizer: Tokenizer, name: str, text: str, content: str | None,
                           expected: list[Call]) -> None:
    cls = ToolParserManager.get_tool_parser(name)
    whole = check_all_splits(cls, tokenizer, text, content, expected)
    if name != "pythonic":  # JSON formats: the arguments are the model's own text
        for c in whole.tool_calls:
            assert c.arguments in text or c.arguments == "{}"


@pytest.mark.parametrize("make,text,content,expected", FORCED, ids=[f"forced-{i}" for i in range(len(FORCED))])
def test_forced_tool_choice_replies(tokenizer: Tokenizer, make: Callable[[], ToolParser], text: str,
                                    content: str | None, expected: list[Call]) -> None:
    check_all_splits(make, tokenizer, text, content, expected)


def args_before_close(parser: ToolParser, head: str, tail: str) -> None:
    """The arguments stream: `head` (cut inside a string of the arguments) already gives
    them up to its end; `tail` gives the rest, nothing beyond the value."""
    first = parser.feed(head)
    assert isinstance(first[-1], ToolArgsDelta) and first[-1].text.endswith('"lo')
    rest = parser.feed(tail) + parser.finish()
    assert [e.text for e in rest if isinstance(e, ToolArgsDelta)] == ['ng"}']


def test_arguments_stream_as_generated() -> None:
    args_before_close(HermesToolParser(), '<tool_call>\n{"name": "f", "arguments": {"a": "lo', 'ng"}}\n</tool_call>')
    args_before_close(Llama3JsonToolParser(), '{"name": "f", "parameters": {"a": "lo', 'ng"}}')
    args_before_close(MistralToolParser(), '[TOOL_CALLS]f[ARGS]{"a": "lo', 'ng"}')
    args_before_close(RequiredToolsParser(), '[{"name": "f", "parameters": {"a": "lo', 'ng"}}]')
    p = HermesToolParser()
    assert p.feed('<tool_call>{"arguments": {"a": 1}, "na') == []  # arguments before the name wait for it
    assert p.feed('me": "f"}') == [ToolCallStart(0, "f"), ToolArgsDelta(0, '{"a": 1}')]


def test_only_what_may_be_a_marker_is_held() -> None:
    p = HermesToolParser()
    assert p.feed("Hi <tool") == [ContentDelta("Hi ")]
    assert p.feed("s") == [ContentDelta("<tools")]
    assert p.feed(" <") == [ContentDelta(" ")] and p.finish() == [ContentDelta("<")]
    m = MistralToolParser()
    assert m.feed("See [TOOL") == [ContentDelta("See ")] and m.feed("S]") == [ContentDelta("[TOOLS]")]
    assert Llama3JsonToolParser().feed("Plain text {") == [ContentDelta("Plain text {")]  # not at the start: prose
    assert PythonicToolParser().feed("No list [f()]") == [ContentDelta("No list [f()]")]


def test_named_tool_parser() -> None:
    p = NamedToolParser([], "f")
    assert p.feed('{"a"') == [ToolCallStart(0, "f"), ToolArgsDelta(0, '{"a"')]
    assert p.feed(": 1}") == [ToolArgsDelta(0, ": 1}")] and p.finish() == []
    # an empty output is still the one call (vLLM's non-streamed reply for a named choice)
    assert collect(NamedToolParser([], "f").finish()).tool_calls == [ToolCall(0, "f", "")]
    with pytest.raises(ValueError):
        NamedToolParser([])


def test_mistral_ids() -> None:
    """Generated ids are fresh per call (random), the model's kept when valid."""
    text = "[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[CALL_ID]Zz9Zz9Zz9[ARGS]{}"
    ids = [c.id for c in collect(run(MistralToolParser(), [text])).tool_calls]
    again = [c.id for c in collect(run(MistralToolParser(), [text])).tool_calls]
    assert ids[1] == again[1] == "Zz9Zz9Zz9" and ids[0] != again[0]


def test_json_value_scanner() -> None:
    s = JsonValueScanner()
    assert s.scan('{"a": "}\\"') == (10, MORE)
    assert s.scan('", "b": [1, {}]} tail') == (16, END)
    assert JsonValueScanner().scan("123, 4") == (3, END)
    assert JsonValueScanner().scan('"x\\\\" y') == (5, END)
    assert JsonValueScanner().scan("[1, 2}") == (5, ERROR)
    assert JsonValueScanner().scan("<x") == (0, ERROR)


def test_registry() -> None:
    assert ToolParserManager.names() == ["hermes", "llama3_json", "llama4_json", "mistral", "pythonic"]
    assert ToolParserManager.list_registered() == ToolParserManager.names()
    special = {n: ToolParserManager.get_tool_parser(n).needs_special_tokens for n in ToolParserManager.names()}
    assert special == {"hermes": True, "llama3_json": False, "llama4_json": False, "mistral": True, "pythonic": False}
    assert ToolParserManager.get_tool_parser("llama4_json") is Llama3JsonToolParser
    for n in ToolParserManager.names():
        assert issubclass(ToolParserManager.get_tool_parser(n), ToolParser)
    with pytest.raises(ValueError, match=r"'nope'.*hermes, llama3_json, llama4_json, mistral, pythonic"):
        ToolParserManager.get_tool_parser("nope")
    from tidal.frontend.entrypoints.openai.chat_tools import tool_parser_class

    assert tool_parser_class("hermes") is HermesToolParser
    with pytest.raises(ValueError, match=r"invalid tool call parser: nope \(chose from \{ hermes,llama3_json,"):
        tool_parser_class("nope")


def test_with_a_reasoning_parser(tokenizer: Tokenizer) -> None:
    """Qwen3: a call written inside the thinking is reasoning; after it, a call."""
    from tidal.frontend.entrypoints.openai.reasoning import ReasoningParserManager

    qwen3 = ReasoningParserManager.get_reasoning_parser("qwen3")
    text = "<think>\nMaybe " + QWEN("x", "{}") + "?\n</think>\n\nSure.\n" + QWEN("get_weather", WJ)
    expected = Reply("\nMaybe " + QWEN("x", "{}") + "?\n", "\n\nSure.\n", [ToolCall(0, "get_weather", WJ)])
    for how, pieces in splits(tokenizer, text).items():
        events = run(ReplyParser(qwen3(""), HermesToolParser()), pieces)
        assert collect(events) == expected, how
        first_call = next(i for i, e in enumerate(events) if isinstance(e, ToolCallStart))
        assert not any(isinstance(e, ReasoningDelta) for e in events[first_call:])
