"""A generated reply split into what each API shows: reasoning, content and tool calls.

One parser object per choice consumes the reply's decoded text as it streams (any split: a
token, a character, random chunks) and returns events; the non-streamed reply is the same
parser fed the whole text at once, then `finish()`. So a streamed reply's joined events equal
the non-streamed one by construction, and each parser must only guarantee that an event, once
returned, is never taken back: text that might still turn into a marker (`<tool_call`, `</thi`)
is held until it is decided.

The chat completions, Responses and Anthropic Messages routes all translate these events into
their own framing (chat deltas, typed Responses events, Anthropic content blocks).

Invariants every parser keeps (tested by feeding each reference output whole, per character,
per token and in random chunks):
- events are returned in reply order; ToolCallStart(i) precedes every ToolArgsDelta(i), and
  call indexes are 0, 1, 2... in order;
- `collect(feed(a) + feed(b) + ... + finish())` is the same for every split of the text.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Generic, TypeVar, Union


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A tool call opens: its name is known. `id` is the model's own when its format has one
    (Mistral's 9-character ids), else None and the route assigns one."""

    index: int
    name: str
    id: str | None = None


@dataclass(frozen=True)
class ToolArgsDelta:
    """More of call `index`'s arguments text (a JSON object's text, streamed as generated)."""

    index: int
    text: str


ReplyEvent = Union[ReasoningDelta, ContentDelta, ToolCallStart, ToolArgsDelta]


@dataclass
class ToolCall:
    index: int
    name: str
    arguments: str = ""
    id: str | None = None


@dataclass
class Reply:
    """A whole reply: reasoning None when there was none, content None when the reply is only
    tool calls (OpenAI's shape), tool_calls in order."""

    reasoning: str | None = None
    content: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)


def collect(events: list[ReplyEvent]) -> Reply:
    """The reply the events spell, joined. An empty-text delta says nothing (so a parser that
    emits one in one split and not in another still spells the same Reply)."""
    reasoning: list[str] | None = None
    content: list[str] | None = None
    calls: list[ToolCall] = []
    for e in events:
        # Appended in place: a per-character stream is thousands of events.
        if isinstance(e, ReasoningDelta):
            if e.text:
                reasoning = reasoning if reasoning is not None else []
                reasoning.append(e.text)
        elif isinstance(e, ContentDelta):
            if e.text:
                content = content if content is not None else []
                content.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append(ToolCall(e.index, e.name, "", e.id))
        elif isinstance(e, ToolArgsDelta):
            calls[e.index].arguments += e.text
    return Reply("".join(reasoning) if reasoning is not None else None,
                 "".join(content) if content is not None else None, calls)


class ToolParser(ABC):
    """An incremental tool-call parser over the content text (after any reasoning). Emits
    ContentDelta, ToolCallStart and ToolArgsDelta only."""

    name: ClassVar[str]
    # True when the format's markers are special tokens the detokenizer would otherwise drop
    # (Mistral's [TOOL_CALLS]): the route decodes with skip_special_tokens=False.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []  # the request's tools (OpenAI's shape), for parsers that need them

    @abstractmethod
    def feed(self, text: str) -> list[ReplyEvent]:
        """Events for `text`, the next piece of the reply; text that may still be a marker is held."""

    @abstractmethod
    def finish(self) -> list[ReplyEvent]:
        """The reply ended: whatever is held, as content (or as the rest of an unfinished call)."""


class ReasoningParser(ABC):
    """An incremental reasoning parser: splits the reply into ReasoningDelta and ContentDelta.
    `prompt` is the rendered prompt text (a template may already have opened the thinking)."""

    name: ClassVar[str]
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, prompt: str = "") -> None:
        self.prompt = prompt

    @abstractmethod
    def feed(self, text: str) -> list[ReplyEvent]:
        """ReasoningDelta and ContentDelta events for `text`, the next piece of the reply;
        only text that may still be a marker (`</thi`) is held."""

    @abstractmethod
    def finish(self) -> list[ReplyEvent]:
        """The reply ended: whatever is held, as what it was (an unclosed thinking stays
        reasoning)."""


def _nonempty(events: list[ReplyEvent]) -> list[ReplyEvent]:
    """`events` less the reasoning and content deltas without text."""
    return [e for e in events if not (isinstance(e, (ContentDelta, ReasoningDelta)) and not e.text)]


class ReplyParser:
    """Reasoning first, then tool calls in the content: the content a reasoning parser emits
    is what the tool parser reads (tool calls and structured outputs apply after the reasoning
    ends, as vLLM's)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolParser | None) -> None:
        self.reasoning, self.tools = reasoning, tools

    def feed(self, text: str) -> list[ReplyEvent]:
        events: list[ReplyEvent] = self.reasoning.feed(text) if self.reasoning else [ContentDelta(text)]
        return self._through_tools(events)

    def finish(self) -> list[ReplyEvent]:
        events = self._through_tools(self.reasoning.finish() if self.reasoning else [])
        if self.tools is not None:
            events += _nonempty(self.tools.finish())
        return events

    def _through_tools(self, events: list[ReplyEvent]) -> list[ReplyEvent]:
        # Empty-text deltas are dropped both ways: a route would otherwise send an empty
        # chunk, and a tool parser need not handle an empty feed.
        out: list[ReplyEvent] = []
        for e in events:
            if isinstance(e, ContentDelta) and self.tools is not None:
                out += self.tools.feed(e.text) if e.text else []
            else:
                out.append(e)
        return _nonempty(out)

    def parse(self, text: str) -> Reply:
        """The non-streamed reply: the same parser fed the whole text."""
        return collect(self.feed(text) + self.finish())


P = TypeVar("P")


class ParserRegistry(Generic[P]):
    """A name -> parser class table (vLLM's ToolParserManager / ReasoningParserManager). Each
    subclass has its own `table` and says what it holds (`kind`, for the error)."""

    kind: ClassVar[str] = "parser"
    table: ClassVar[dict[str, Any]]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.table = {}

    @classmethod
    def register(cls, parser: type[P], name: str | None = None) -> type[P]:
        """Register `parser` under `name` (default: its `name`); a name is registered once."""
        key = name or getattr(parser, "name")
        if key in cls.table and cls.table[key] is not parser:
            raise ValueError(f"{cls.kind} {key!r} is already registered")
        cls.table[key] = parser
        return parser

    @classmethod
    def register_module(cls, name: str) -> Callable[[type[P]], type[P]]:
        """A class decorator registering under `name` (vLLM's spelling)."""
        return lambda parser: cls.register(parser, name)

    @classmethod
    def get(cls, name: str) -> type[P]:
        try:
            return cls.table[name]  # type: ignore[no-any-return]
        except KeyError:
            raise ValueError(f"unknown {cls.kind} {name!r}; known: {', '.join(cls.names())}") from None

    @classmethod
    def names(cls) -> list[str]:
        return sorted(cls.table)

    @classmethod
    def list_registered(cls) -> list[str]:
        """names(), under vLLM's name (chat_tools reads it for its error message)."""
        return cls.names()
