"""`hermes` (Qwen2.5, Qwen3, Hermes 2/3): calls as `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
any number of them, with text before, between and after.

Outcomes (the same however the text is split):
- the call starts when its "name" string is complete (keys in any order: arguments seen
  before the name are sent right after the start); the arguments are the raw text of the
  "arguments" value, streamed as generated; a call object without arguments gets "{}";
- `</tool_call>` after the object is consumed; a missing one is tolerated (the next
  `<tool_call>` or text simply follows);
- a `<tool_call>` that turns out not to be a call before its name is known (no object, a key
  structure that breaks, an object closing without a string name) is content, marker and all;
  a reply cut off (max_tokens) before the name is likewise content (vLLM's non-streamed
  outcome for an unparsable call);
- once a call started it stands: an object that breaks after that ends the call, and the text
  up to `</tool_call>` (the rest of the tags' inside) is dropped; cut off mid-arguments, the
  call keeps the arguments as far as they got.
Content follows common.Emitter's rule (whitespace-only segments next to calls are dropped).
As vLLM's hermes parser (adjust_request), the route decodes with skip_special_tokens=False:
some models mark `<tool_call>` special.
"""
from __future__ import annotations

from typing import Any

from tidal.frontend.entrypoints.openai.tool_parsers.common import StateMachineParser, find_marker, leading_space
from tidal.frontend.entrypoints.openai.tool_parsers.json_scan import END, MORE, CallObject

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_TEXT, _CALL, _AFTER, _SKIP = range(4)


class HermesToolParser(StateMachineParser):
    name = "hermes"
    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.state = _TEXT
        self.call: CallObject | None = None

    def _end(self) -> None:
        if self.state == _TEXT:
            self.out.content(self.buf)  # a partial marker that never completed
        elif self.state == _CALL and self.call is not None and not self.call.started:
            self.out.content(OPEN + self.call.raw)  # cut off before the name: no call
        # _AFTER (whitespace, a partial end tag) and _SKIP (inside a broken call) are dropped;
        # a started call cut off keeps what it had.

    def _run(self) -> None:
        """Decide as much of `buf` as its text allows; what stays in `buf` needs more text."""
        while self.buf:
            buf = self.buf
            if self.state == _TEXT:
                n, found = find_marker(buf, OPEN)
                self.out.content(buf[:n])
                if not found:
                    self.buf = buf[n:]
                    return
                self.buf, self.state = buf[n + len(OPEN):], _CALL
                self.call = CallObject(self.out)
            elif self.state == _CALL:
                assert self.call is not None
                i, status = self.call.scan(buf)
                self.buf = buf[i:]
                if status == MORE:
                    return
                if not self.call.started:  # no call after all: the marker and its text are content
                    self.out.content(OPEN + self.call.raw)
                    self.state = _TEXT
                else:
                    self.state = _AFTER if status == END else _SKIP
            elif self.state == _AFTER:
                rest = buf[leading_space(buf):]
                if rest.startswith(CLOSE):
                    self.buf, self.state = rest[len(CLOSE):], _TEXT
                elif CLOSE.startswith(rest):
                    return  # whitespace, maybe a partial end tag: wait
                else:
                    self.state = _TEXT  # no end tag: the text goes on as text
            else:  # _SKIP: a started call broke; drop the rest of its tags' inside
                n, found = find_marker(buf, CLOSE)
                if not found:
                    self.buf = buf[n:]
                    return
                self.buf, self.state = buf[n + len(CLOSE):], _TEXT

