"""`llama3_json` (Llama 3.1/3.2/3.3 and 4 with vLLM's JSON tool templates; `llama4_json` is the
same parser): the reply is an optional `<|python_tag|>` and then calls as JSON objects
`{"name": ..., "parameters": {...}}` ("arguments" is accepted too, whichever comes first),
several separated by `;`.

As vLLM's streaming parser (which only reads a reply that starts with the tag or `{`), calls
are only looked for at the start of the reply (after leading whitespace): a reply that starts
with anything else is all content, streamed at once, and a `{` later in prose is prose (vLLM's
non-streamed parser would also try a `{` in the middle of text: its streamed and non-streamed
replies then differ; here they cannot). Outcomes:
- the call starts when its "name" string is complete (keys in any order, e.g. Llama's
  `{"type": "function", "name": ...}`); its arguments are the raw value text, streamed;
  none at all gives "{}";
- an object that is no call (closes without a string name, or breaks before it: a plain JSON
  answer such as `{"answer": 42}`) is content, from the reply's start (tag included) or from
  the `;` that introduced it; held until decided;
- once a call started it stands; text after a call that is not `; {...}` is content (the
  whitespace right after a call is dropped), and an object that breaks after its start ends
  the call there, the rest being content. Cut off mid-arguments, a call keeps what it had.
`<|python_tag|>` is a special token: with skip_special_tokens the route never sees it, and the
JSON alone reads the same.
"""
from __future__ import annotations

from typing import Any

from tidal.frontend.entrypoints.openai.tool_parsers.common import StateMachineParser, leading_space
from tidal.frontend.entrypoints.openai.tool_parsers.json_scan import END, MORE, CallObject

TAG = "<|python_tag|>"
_LEAD, _CALL, _AFTER, _TEXT = range(4)


class Llama3JsonToolParser(StateMachineParser):
    name = "llama3_json"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.state = _LEAD
        self.prefix = ""  # the text before the current object (the tag, a `;`): content if no call comes
        self.call: CallObject | None = None

    def _end(self) -> None:
        if self.state == _LEAD:
            self.out.content(self.buf)  # whitespace, or a partial tag
        elif self.state == _CALL and self.call is not None and not self.call.started:
            self.out.content(self.prefix + self.call.raw)  # cut off before the name
        # _AFTER holds only the whitespace after a call (dropped); _TEXT holds nothing.

    def _object(self, prefix: str) -> None:
        self.prefix, self.state = prefix, _CALL
        self.call = CallObject(self.out, args_keys=("parameters", "arguments"))

    def _run(self) -> None:
        while self.buf:
            buf = self.buf
            if self.state == _LEAD:
                k = leading_space(buf)
                rest = buf[k:]
                if rest.startswith(TAG):
                    self.buf = rest[len(TAG):]
                    self._object(buf[:k + len(TAG)])
                elif rest.startswith("{"):
                    self.buf = rest
                    self._object(buf[:k])
                elif not rest or TAG.startswith(rest):
                    return  # whitespace, maybe a partial tag: wait
                else:
                    self.state = _TEXT
            elif self.state == _CALL:
                assert self.call is not None
                i, status = self.call.scan(buf)
                self.buf = buf[i:]
                if status == MORE:
                    return
                if not self.call.started:  # no call: what it was is content, and so is the rest
                    self.out.content(self.prefix + self.call.raw)
                    self.state = _TEXT
                else:
                    self.state = _AFTER if status == END else _TEXT
            elif self.state == _AFTER:
                k = leading_space(buf)
                if k == len(buf):
                    return
                if buf[k] == ";":
                    self.buf = buf[k + 1:]
                    self._object(buf[:k + 1])
                else:
                    self.state = _TEXT
            else:  # _TEXT: no more calls, everything is content
                self.out.content(buf)
                self.buf = ""
