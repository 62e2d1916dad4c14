"""The `<think>` reasoning parsers (qwen3, deepseek_r1) and their composition with a tool
parser (issue 35 item 3): each reference reply, fed whole, per character, per token of a real
tokenizer and in random chunks, spells the same Reply, and that Reply is the hand-written one.
Pure Python: no model, no torch."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from tokenizers import Tokenizer

from parser_utils import byte_bpe_tokenizer, run, splits

from tidal.frontend.entrypoints.openai.reasoning import ReasoningParserManager
from tidal.frontend.entrypoints.openai.reply import (
    ContentDelta, ReasoningDelta, ReasoningParser, Reply, ReplyEvent, ReplyParser, ToolArgsDelta, ToolCall,
    ToolCallStart, ToolParser, collect)

NEUTRAL = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"  # the model opens it, or not
OPENED = NEUTRAL + "<think>\n"  # Qwen3 thinking models, DeepSeek-R1
CLOSED = NEUTRAL + "<think>\n\n</think>\n\n"  # Qwen3's enable_thinking=False
# A history turn's closed block is not this reply's: the generation prompt is neutral.
HISTORY = ("<|im_start|>assistant\n<think>\nold\n</think>\n\nOld.<|im_end|>\n<|im_start|>user\nAnd?<|im_end|>\n"
           "<|im_start|>assistant\n")


def R(reasoning: str | None, content: str | None, calls: list[ToolCall] | None = None) -> Reply:
    return Reply(reasoning, content, calls or [])


BOTH = "<think>\nLet me add 2 and 2.\n</think>\n\nThe answer is 4."
# (prompt, reply text, qwen3's Reply, deepseek_r1's Reply)
CASES: list[tuple[str, str, Reply, Reply]] = [
    # thinking then answer; the whitespace after </think> is content, as vLLM's
    (NEUTRAL, BOTH, R("\nLet me add 2 and 2.\n", "\n\nThe answer is 4."),
     R("\nLet me add 2 and 2.\n", "\n\nThe answer is 4.")),
    (HISTORY, BOTH, R("\nLet me add 2 and 2.\n", "\n\nThe answer is 4."),
     R("\nLet me add 2 and 2.\n", "\n\nThe answer is 4.")),
    # no thinking: qwen3 reads an answer, deepseek_r1 a thinking without its start tag
    (NEUTRAL, "The answer is 4.", R(None, "The answer is 4."), R("The answer is 4.", None)),
    (HISTORY, "Plain.", R(None, "Plain."), R("Plain.", None)),
    (NEUTRAL, "I am sure.</think> Done", R(None, "I am sure.</think> Done"), R("I am sure.", " Done")),
    # thinking opened by the prompt (a duplicate start tag in the reply is dropped)
    (OPENED, "Let me add.\n</think>\n\n4", R("Let me add.\n", "\n\n4"), R("Let me add.\n", "\n\n4")),
    (OPENED, "<think>\nabc</think>d", R("\nabc", "d"), R("\nabc", "d")),
    (OPENED, "  x</think>", R("  x", None), R("  x", None)),
    # closed by the prompt: all content, tags and all
    (CLOSED, "<think>x</think>y", R(None, "<think>x</think>y"), R(None, "<think>x</think>y")),
    (CLOSED, "The answer is 4.", R(None, "The answer is 4."), R(None, "The answer is 4.")),
    # thinking never closed (max_tokens): all reasoning, a dangling partial tag included
    (NEUTRAL, "<think>\nStill adding 2 and", R("\nStill adding 2 and", None), R("\nStill adding 2 and", None)),
    (OPENED, "Still adding </thi", R("Still adding </thi", None), R("Still adding </thi", None)),
    # tag look-alikes split anywhere
    (NEUTRAL, "<think>a </th b < /think> </thinking></think>c", R("a </th b < /think> </thinking>", "c"),
     R("a </th b < /think> </thinking>", "c")),
    (NEUTRAL, "<thinking>x", R(None, "<thinking>x"), R("<thinking>x", None)),
    (NEUTRAL, "<thi", R(None, "<thi"), R("<thi", None)),
    (NEUTRAL, "\n\n<think>a</think>b", R("a", "b"), R("a", "b")),
    (NEUTRAL, "\n", R(None, "\n"), R("\n", None)),
    (NEUTRAL, "", R(None, None), R(None, None)),
    # <think> text inside the answer stays answer text
    (NEUTRAL, "Use <think> like <think>this</think>.", R(None, "Use <think> like <think>this</think>."),
     R("Use <think> like <think>this", ".")),
    (NEUTRAL, "<think>a</think>b <think>c</think>", R("a", "b <think>c</think>"), R("a", "b <think>c</think>")),
    # empty thinkings
    (NEUTRAL, "<think>\n\n</think>\n\nHi", R("\n\n", "\n\nHi"), R("\n\n", "\n\nHi")),
    (NEUTRAL, "<think></think>", R(None, None), R(None, None)),
    # multi-byte text (split inside characters by the byte-level tokenizer)
    (NEUTRAL, "<think>\n思考 ü…</think>答え ✓", R("\n思考 ü…", "答え ✓"), R("\n思考 ü…", "答え ✓")),
]
PARSERS = {"qwen3": 2, "deepseek_r1": 3}  # name -> its column in CASES
IDS = [f"{i}-{text[:18]!r}" for i, (_, text, _, _) in enumerate(CASES)]


@pytest.fixture(scope="module")
def tokenizer(tidal_cache_dir: str) -> Iterator[Tokenizer]:
    """make_model's byte-level BPE (512 tokens: `<think>` is several tokens, as with any
    tokenizer that lacks it as an added token)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TIDAL_CACHE_DIR", tidal_cache_dir)
        yield byte_bpe_tokenizer()


def check_stream(events: list[ReplyEvent]) -> None:
    """No empty deltas; reasoning never after content (nothing taken back)."""
    seen_content = False
    for e in events:
        if isinstance(e, (ContentDelta, ReasoningDelta)):
            assert e.text
        seen_content = seen_content or not isinstance(e, ReasoningDelta)
        assert not (seen_content and isinstance(e, ReasoningDelta)), events


@pytest.mark.parametrize("name", list(PARSERS))
@pytest.mark.parametrize("prompt,text,q,d", CASES, ids=IDS)
def test_reference_replies(tokenizer: Tokenizer, name: str, prompt: str, text: str, q: Reply, d: Reply) -> None:
    expected = {"qwen3": q, "deepseek_r1": d}[name]
    cls = ReasoningParserManager.get_reasoning_parser(name)
    for how, pieces in splits(tokenizer, text).items():
        events = run(cls(prompt), pieces)
        check_stream(events)
        assert collect(events) == expected, (name, how)


@pytest.mark.parametrize("name", list(PARSERS))
def test_only_a_partial_tag_is_held(name: str) -> None:
    p = ReasoningParserManager.get_reasoning_parser(name)(NEUTRAL)
    assert p.feed(" <th") == []  # whitespace and a partial start tag: undecided
    assert p.feed("ink>ab") == [ReasoningDelta("ab")]
    assert p.feed("c</thi") == [ReasoningDelta("c")]  # the partial end tag is held, nothing else
    assert p.feed("s") == [ReasoningDelta("</this")]  # it was not the tag after all
    assert p.feed("<") == [] and p.feed("/think>\n\nx") == [ContentDelta("\n\nx")]
    assert p.feed("</think>") == [ContentDelta("</think>")] and p.finish() == []


def test_registry() -> None:
    assert ReasoningParserManager.names() == ["deepseek_r1", "qwen3"]
    assert ReasoningParserManager.list_registered() == ReasoningParserManager.names()
    for name in PARSERS:
        cls = ReasoningParserManager.get_reasoning_parser(name)
        assert issubclass(cls, ReasoningParser) and cls.name == name and not cls.needs_special_tokens
    with pytest.raises(ValueError, match=r"'nope'.*deepseek_r1, qwen3"):
        ReasoningParserManager.get_reasoning_parser("nope")
    from tidal.frontend.entrypoints.openai.chat_tools import reasoning_parser_class

    with pytest.raises(ValueError, match=r"invalid reasoning parser: nope \(chose from \{ deepseek_r1,qwen3 \}\)"):
        reasoning_parser_class("nope")


class CallParser(ToolParser):
    """A toy format: `CALL(name){json object}` anywhere in the content is a call (no braces
    inside its strings)."""

    name = "toy"
    MARK = "CALL("

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.buf, self.calls, self.state, self.depth = "", 0, "text", 0  # state: text, name or args

    def feed(self, text: str) -> list[ReplyEvent]:
        self.buf += text
        out: list[ReplyEvent] = []
        while self.buf:
            if self.state == "text":
                at = self.buf.find(self.MARK)
                if at < 0:  # hold a suffix that may still become the marker
                    keep = next((n for n in range(len(self.MARK) - 1, 0, -1) if self.buf.endswith(self.MARK[:n])), 0)
                    text, self.buf = self.buf[:len(self.buf) - keep], self.buf[len(self.buf) - keep:]
                    return out + ([ContentDelta(text)] if text else [])
                out += [ContentDelta(self.buf[:at])] if at else []
                self.buf, self.state = self.buf[at + len(self.MARK):], "name"
            elif self.state == "name":
                end = self.buf.find("){")
                if end < 0:
                    return out
                out.append(ToolCallStart(self.calls, self.buf[:end]))
                self.buf, self.state, self.depth = self.buf[end + 1:], "args", 0
            else:
                n = 0
                for n, ch in enumerate(self.buf, 1):
                    self.depth += {"{": 1, "}": -1}.get(ch, 0)
                    if self.depth == 0:
                        break
                out.append(ToolArgsDelta(self.calls, self.buf[:n]))
                self.buf = self.buf[n:]
                if self.depth == 0:
                    self.calls, self.state = self.calls + 1, "text"
        return out

    def finish(self) -> list[ReplyEvent]:
        rest, self.buf = self.buf, ""
        return [ContentDelta(rest)] if rest and self.state == "text" else []


def call(i: int, name: str, args: dict[str, Any]) -> ToolCall:
    return ToolCall(i, name, json.dumps(args))


COMPOSED: list[tuple[str, str, str, Reply]] = [
    ("qwen3", NEUTRAL, '<think>\nI could CALL(get){"a": 1} now.\n</think>\n\nSure. CALL(get_weather){"city": "Paris"}'
     ' CALL(add){"x": {"y": 2}}', R('\nI could CALL(get){"a": 1} now.\n', "\n\nSure.  ",
                                   [call(0, "get_weather", {"city": "Paris"}), call(1, "add", {"x": {"y": 2}})])),
    # a thinking never closed: the call-looking text stays reasoning, no call is made
    ("deepseek_r1", OPENED, 'maybe CALL(get){"a": 1} and', R('maybe CALL(get){"a": 1} and', None)),
    ("deepseek_r1", OPENED, 'x</think>CALL(f){}', R("x", None, [ToolCall(0, "f", "{}")])),
    ("qwen3", CLOSED, 'CALL(f){"k": [1]}', R(None, None, [call(0, "f", {"k": [1]})])),
    ("qwen3", NEUTRAL, "no call, CALL( unfinished", R(None, "no call, ")),
]


@pytest.mark.parametrize("name,prompt,text,expected", COMPOSED, ids=[c[2][:20] for c in COMPOSED])
def test_tool_calls_only_after_the_reasoning(tokenizer: Tokenizer, name: str, prompt: str, text: str,
                                             expected: Reply) -> None:
    cls = ReasoningParserManager.get_reasoning_parser(name)
    assert ReplyParser(cls(prompt), CallParser()).parse(text) == expected  # the non-streamed reply
    for how, pieces in splits(tokenizer, text).items():
        events = run(ReplyParser(cls(prompt), CallParser()), pieces)
        assert collect(events) == expected, how
        starts = [e.index for e in events if isinstance(e, ToolCallStart)]
        assert starts == list(range(len(expected.tool_calls)))
        first_call = next((i for i, e in enumerate(events) if isinstance(e, ToolCallStart)), len(events))
        assert not any(isinstance(e, ReasoningDelta) for e in events[first_call:])


def test_reply_parser_without_parsers() -> None:
    """No reasoning parser: the text is content; no tool parser: content passes through, and
    neither way leaves an empty delta."""
    assert run(ReplyParser(None, None), ["a", "", "b"]) == [ContentDelta("a"), ContentDelta("b")]
    assert ReplyParser(None, CallParser()).parse("CALL(f){}") == R(None, None, [ToolCall(0, "f", "{}")])
    qwen3 = ReasoningParserManager.get_reasoning_parser("qwen3")
    events = run(ReplyParser(qwen3(NEUTRAL), None), ["<think>", "x</think>"])
    assert events == [ReasoningDelta("x")] and collect(events) == R("x", None)
    assert collect([ContentDelta(""), ReasoningDelta("")]) == R(None, None)
