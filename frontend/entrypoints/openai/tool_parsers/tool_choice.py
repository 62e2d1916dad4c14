"""The parsers for a tool_choice the chat route enforces through structured outputs (as vLLM
does): the model's whole output is then JSON of the server's own format, not the model's, so
these need no --tool-call-parser (see chat_tools.tool_schema for the schemas).

- RequiredToolsParser, `tool_choice: "required"`: the output is an array
  `[{"name": "f", "parameters": {...}}, ...]`; each item is a call, its arguments the raw text
  of "parameters", streamed as generated.
- NamedToolParser, a named tool_choice: the output is exactly that function's arguments
  object; one call, started before any text, the whole text its arguments.
The grammar makes other text impossible; should some come anyway (no grammar backend, a reply
cut off before its first call), it is content by the same rules as the model formats'.
"""
from __future__ import annotations

from typing import Any

from tidal.frontend.entrypoints.openai.reply import ReplyEvent, ToolArgsDelta, ToolCallStart, ToolParser
from tidal.frontend.entrypoints.openai.tool_parsers.common import StateMachineParser
from tidal.frontend.entrypoints.openai.tool_parsers.json_scan import ERROR, MORE, CallArray, CallObject


class RequiredToolsParser(StateMachineParser):
    name = "tool_choice_required"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.array: CallArray | None = CallArray(lambda: CallObject(self.out, args_keys=("parameters",)))

    def _end(self) -> None:
        if self.array is not None:
            self.out.content(self.array.raw)  # cut off: what no call was made of is content

    def _run(self) -> None:
        if self.array is None:  # after the array (or where it broke): text
            self.out.content(self.buf)
            self.buf = ""
            return
        i, status = self.array.scan(self.buf)
        self.buf = self.buf[i:]
        if status == MORE:
            return
        if status == ERROR:
            self.out.content(self.array.raw)  # broke: its text since the last call is content
        self.array = None
        self._run()


class NamedToolParser(ToolParser):
    name = "tool_choice_named"

    def __init__(self, tools: list[dict[str, Any]] | None = None, name: str | None = None) -> None:
        super().__init__(tools)
        if not name:
            raise ValueError("NamedToolParser needs the function's name")
        self.function = name
        self.started = False

    def _start(self) -> list[ReplyEvent]:
        if self.started:
            return []
        self.started = True
        return [ToolCallStart(0, self.function)]

    def feed(self, text: str) -> list[ReplyEvent]:
        out = self._start()
        if text:
            out.append(ToolArgsDelta(0, text))
        return out

    def finish(self) -> list[ReplyEvent]:
        return self._start()  # an empty output is still the call vLLM returns (arguments "")

