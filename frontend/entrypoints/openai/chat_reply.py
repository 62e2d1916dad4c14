"""A chat choice's reply in OpenAI's shapes: the reply parser's events (reply.py) as a whole
message, or as stream deltas, with tool call ids and the finish reason.

- message: `content` None when the reply is only tool calls; `tool_calls[i]` = {id, type
  "function", function: {name, arguments}}; the reasoning under `reasoning_content` and
  `reasoning` (see protocol.ChatMessage).
- deltas: one per engine output, holding what its events add; a call's first delta carries
  its index, id, type and name (and `arguments: ""` as OpenAI's do), the next ones only its
  index and argument text; fields with nothing new are absent, never null (vLLM's bug list
  has clients that broke on `"content": null` and null ids/names in tool call deltas).
- ids: "chatcmpl-tool-" + a digest of (response id, choice, call index), so the same request
  (same X-Request-Id) streamed and not streamed names its calls alike; a format's own ids
  (Mistral's) are kept.
- finish_reason: "tool_calls" when calls were made and the model stopped ("auto" and
  "required", as vLLM's and OpenAI's); a named tool_choice keeps "stop" (theirs too), and a
  reply cut by max_tokens keeps "length".
- parallel_tool_calls false: calls after the first are dropped (vLLM's
  maybe_filter_parallel_tool_calls; "required" is held to one call by its schema already).
"""
from __future__ import annotations

import hashlib

from tidal.frontend.entrypoints.openai.protocol import (
    ChatMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from tidal.frontend.entrypoints.openai.reply import (
    ContentDelta,
    ReasoningDelta,
    ReplyEvent,
    ReplyParser,
    ToolArgsDelta,
    ToolCallStart,
    collect,
)


def tool_call_id(response_id: str, choice: int, index: int) -> str:
    """The id of call `index` of choice `choice`: a pure function of the response's id."""
    digest = hashlib.sha256(f"{response_id}\0{choice}\0{index}".encode()).hexdigest()[:32]
    return f"chatcmpl-tool-{digest}"


class ChoiceReply:
    """One choice's parser, and what its reply has said so far."""

    def __init__(self, parser: ReplyParser, response_id: str, choice: int, *, parallel: bool = True,
                 named: bool = False, include_reasoning: bool = True) -> None:
        self.parser, self.response_id, self.choice = parser, response_id, choice
        self.parallel, self.named, self.include_reasoning = parallel, named, include_reasoning
        self.called = False  # a tool call was made (kept, after the parallel filter)
        self._ids: dict[int, str] = {}

    def events(self, text: str, last: bool = False) -> list[ReplyEvent]:
        """The events `text` (the next piece of the reply) adds; with `last`, the parser's rest too."""
        out = self.parser.feed(text) if text else []
        if last:
            out += self.parser.finish()
        kept: list[ReplyEvent] = []
        for e in out:
            if isinstance(e, (ToolCallStart, ToolArgsDelta)) and e.index > 0 and not self.parallel:
                continue
            if isinstance(e, ReasoningDelta) and not self.include_reasoning:
                continue
            if isinstance(e, ToolArgsDelta) and not e.text:
                continue  # nothing to send: a delta of "" arguments is noise on the wire
            if isinstance(e, ToolCallStart):
                self.called = True
                self._ids[e.index] = e.id or tool_call_id(self.response_id, self.choice, e.index)
            kept.append(e)
        return kept

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason == "stop" and self.called and not self.named:
            return "tool_calls"
        return engine_reason

    def message(self, role: str, text: str, echoed: str = "") -> ChatMessage:
        """The whole reply of `text`, as a message (content after the echoed text, if any)."""
        reply = collect(self.events(text, last=True))
        content = reply.content
        if reply.tool_calls and content is not None and not content.strip():
            content = None  # only calls (the whitespace between them is no content)
        elif content is None and not reply.tool_calls:
            content = ""  # an empty reply is empty content, as without parsers
        if echoed:
            content = echoed + (content or "")
        calls = [ToolCall(id=self._ids[c.index], function=FunctionCall(c.name, c.arguments)) for c in reply.tool_calls]
        reasoning = reply.reasoning
        return ChatMessage(role, content, calls, reasoning, reasoning)

    def delta(self, events: list[ReplyEvent]) -> DeltaMessage:
        """One chunk's delta of `events` (empty: `{}`)."""
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, DeltaToolCall] = {}
        for e in events:
            if isinstance(e, ContentDelta):
                content.append(e.text)
            elif isinstance(e, ReasoningDelta):
                reasoning.append(e.text)
            elif isinstance(e, ToolCallStart):
                calls[e.index] = DeltaToolCall(e.index, self._ids[e.index], "function",
                                               DeltaFunctionCall(e.name, ""))
            elif isinstance(e, ToolArgsDelta):
                call = calls.get(e.index)
                if call is None:
                    calls[e.index] = DeltaToolCall(e.index, function=DeltaFunctionCall(arguments=e.text))
                else:
                    assert call.function is not None and call.function.arguments is not None
                    call.function.arguments += e.text
        text, thought = "".join(content), "".join(reasoning)
        return DeltaMessage(content=text or None, reasoning_content=thought or None, reasoning=thought or None,
                            tool_calls=list(calls.values()) or None)


def is_empty(delta: DeltaMessage) -> bool:
    return delta.content is None and delta.reasoning is None and delta.tool_calls is None and delta.role is None
