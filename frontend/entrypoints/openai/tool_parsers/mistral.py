"""`mistral`: both of Mistral's formats, told apart by what follows `[TOOL_CALLS]`:
- tokenizers before v11 (Mistral-7B-Instruct-v0.3, Mixtral-8x22B): `[TOOL_CALLS] [{"name": ...,
  "arguments": {...}, "id": "..."}, ...]`, one JSON array of calls;
- v11 and later (Mistral Small 3.x, Devstral, Magistral): `[TOOL_CALLS]name[ARGS]{...}` per call,
  v13's `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` included (and `name{...}` when the special
  `[ARGS]` was dropped from the text).

Text before the first `[TOOL_CALLS]` is content, as vLLM's. A call's id is the model's own when
it gave a valid one (9 alphanumerics, what Mistral's templates accept back); otherwise a fresh
random one of that shape (vLLM's MistralToolCall), never None, since a route-made id would not
round-trip through the template. The markers are special tokens: needs_special_tokens.

Outcomes (the same however the text is split):
- array format: the id may follow the arguments, and a ToolCallStart carries it, so each call
  is sent whole when its object closes (arguments then arrive at once, not per token);
  an array that is no calls before any call is content from its marker on; once a call was
  sent, a broken remainder is content from where it broke; cut off, the unsent object is content;
- v11 format: the call starts at `[ARGS]` (or `{`), its arguments streamed as the raw value;
  arguments that are not JSON are still the call's, raw up to the next `[TOOL_CALLS]` (vLLM
  returns malformed v11 calls as calls too); a name with characters no function name has is
  content, marker and all;
- after a call, whitespace is dropped; other text is content; `[TOOL_CALLS]` opens more calls
  (several arrays included, which vLLM's non-streamed parser refuses).
"""
from __future__ import annotations

import random
import re
import string
from typing import Any

from tidal.frontend.entrypoints.openai.tool_parsers.common import StateMachineParser, find_marker, leading_space
from tidal.frontend.entrypoints.openai.tool_parsers.json_scan import END, MORE, CallArray, CallObject, JsonValueScanner

BOT, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
_NAME_RUN = re.compile(r"[\w.\-]*")  # the characters of a function name
_ID_RUN = re.compile(r"[A-Za-z0-9]*")
_ALNUM = string.ascii_letters + string.digits
_TEXT, _MARK, _ARRAY, _NAME, _ID, _ARGS, _RAW = range(7)


def mistral_id(model_id: str | None = None) -> str:
    """The model's id when Mistral's templates accept it back, else a new one of that shape."""
    if model_id is not None and len(model_id) == 9 and model_id.isascii() and model_id.isalnum():
        return model_id
    return "".join(random.choices(_ALNUM, k=9))


class MistralToolParser(StateMachineParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.state = _TEXT
        self.raw = ""  # since the marker, while no call of it started: content if none does
        self.array: CallArray | None = None
        self.name_text = ""  # v11: the name (then the id) read so far
        self.id_text = ""
        self.value: JsonValueScanner | None = None

    def _end(self) -> None:
        if self.state == _TEXT:
            self.out.content(self.buf)  # a partial marker
        elif self.state in (_MARK, _NAME, _ID):
            self.out.content(self.raw + self.buf)  # cut off before a call began
        elif self.state == _ARRAY and self.array is not None:
            self.out.content(self.array.raw if self.array.any_started else self.raw + self.array.raw)
        elif self.state == _RAW:
            self.out.args(self.buf)  # a partial marker inside raw arguments

    def _run(self) -> None:
        while self.buf:
            buf = self.buf
            st = self.state
            if st == _TEXT:
                n, found = find_marker(buf, BOT)
                self.out.content(buf[:n])
                if not found:
                    self.buf = buf[n:]
                    return
                self.buf, self.raw, self.state = buf[n + len(BOT):], BOT, _MARK
            elif st == _MARK:
                k = leading_space(buf)
                if k == len(buf):
                    return
                if buf[k] == "[" and k + 1 == len(buf):
                    return  # `[{` opens an array, `[T` may be a second marker
                if buf[k] == "[" and buf[k + 1] != "T":
                    self.raw += buf[:k]
                    self.buf, self.state = buf[k:], _ARRAY
                    self.array = CallArray(lambda: CallObject(self.out, id_key="id", hold=True, id_of=mistral_id))
                elif _NAME_RUN.match(buf, k).end() > k:  # type: ignore[union-attr]
                    self.raw += buf[:k]
                    self.buf, self.name_text, self.state = buf[k:], "", _NAME
                else:
                    self._not_a_call()
            elif st == _ARRAY:
                assert self.array is not None
                i, status = self.array.scan(buf)
                self.buf = buf[i:]
                if status == MORE:
                    return
                if status != END:  # broke: content from its marker, or from after the last call
                    self.out.content(self.array.raw if self.array.any_started else self.raw + self.array.raw)
                self.state = _TEXT  # after the calls: text (whitespace dropped), or more calls
            elif st in (_NAME, _ID):
                run = (_NAME_RUN if st == _NAME else _ID_RUN).match(buf).end()  # type: ignore[union-attr]
                if st == _NAME:
                    self.name_text += buf[:run]
                else:
                    self.id_text += buf[:run]
                self.raw += buf[:run]
                rest = buf[run:]
                self.buf = rest
                if not rest:
                    return
                if st == _NAME and rest.startswith(CALL_ID) and self.name_text:
                    self.buf, self.raw, self.id_text, self.state = rest[len(CALL_ID):], self.raw + CALL_ID, "", _ID
                elif rest.startswith(ARGS) and (self.name_text if st == _NAME else self.id_text):
                    self._start(rest[len(ARGS):])
                elif st == _NAME and rest[0] == "{" and self.name_text:
                    self._start(rest)
                elif rest[0] == "[" and (ARGS.startswith(rest) or st == _NAME and CALL_ID.startswith(rest)):
                    return  # a partial [ARGS] or [CALL_ID]: wait
                else:
                    self._not_a_call()
            elif st == _ARGS:
                if self.value is None:
                    k = leading_space(buf)
                    if k == len(buf):
                        return  # the whitespace before the arguments is no part of them
                    buf, self.value = buf[k:], JsonValueScanner()
                    if buf[0] not in "{[":  # no JSON arguments: raw, as vLLM's
                        self.buf, self.state = buf, _RAW
                        continue
                i, status = self.value.scan(buf)
                self.out.args(buf[:i])
                self.buf = buf[i:]
                if status == MORE:
                    return
                self.state = _TEXT if status == END else _RAW
            elif st == _RAW:
                n, found = find_marker(buf, BOT)
                self.out.args(buf[:n])
                self.buf = buf[n:]
                if not found:
                    return
                self.state = _TEXT

    def _start(self, rest: str) -> None:
        """A v11 call's name (and id) are complete: it starts; `rest` begins its arguments."""
        self.out.start(self.name_text, mistral_id(self.id_text or None))
        self.buf, self.value, self.state = rest, None, _ARGS

    def _not_a_call(self) -> None:
        """What followed the marker is no call: the marker and its text are content."""
        self.out.content(self.raw)
        self.raw, self.state = "", _TEXT
