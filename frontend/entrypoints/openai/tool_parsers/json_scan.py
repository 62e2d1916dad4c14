"""Incremental JSON scanning for the tool-call formats: where a value ends in a growing text, and
the calls written as JSON objects (`{"name": ..., "arguments": {...}}`) and arrays of them.

The scanners are structural, not validating: brackets must match and strings (with their
escapes) are skipped whole, so a `}` or `"` inside a string never ends anything; numbers and
literals are not checked. Every `scan(text, pos)` consumes `text[pos:]` and returns
`(i, status)`:
- MORE: all of it belongs to what is scanned (i == len(text)); call again with more text;
- END: it ended just before i (`text[pos:i]` was its rest; text[i:] is not part of it);
- ERROR: text[i] cannot continue it (text[pos:i] was consumed).
A scanner is fed each character once, in order, so its result never depends on how the text
was split.
"""
from __future__ import annotations

import json
import re
from typing import Callable

from tidal.frontend.entrypoints.openai.tool_parsers.common import Emitter

MORE, END, ERROR = 0, 1, 2
_STRING_RUN = re.compile(r'[^"\\]*')  # a string's characters up to a quote or an escape
_CLOSER_OF = {"}": "{", "]": "["}


def _string(text: str) -> str | None:
    """The JSON string `text` spells, or None when it spells no string (a number, a bad escape)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _scalar_char(ch: str) -> bool:
    """A character of a number or a literal (true, false, null)."""
    return ch.isalnum() or ch in "+-."


class JsonValueScanner:
    """Finds where one JSON value, starting at its first character (no leading whitespace),
    ends. A top-level number or literal ends at the first character that cannot be part of it,
    so it is only known complete then, or when the text ends (`open_scalar`)."""

    def __init__(self) -> None:
        self.stack: list[str] = []  # the open '{' and '['
        self.in_string = False
        self.escape = False  # the previous character was a backslash inside a string
        self.started = False
        self.open_scalar = False  # a top-level number or literal, not yet delimited

    def scan(self, text: str, pos: int = 0) -> tuple[int, int]:
        i, n = pos, len(text)
        while i < n:
            if self.in_string:
                if self.escape:
                    self.escape, i = False, i + 1
                    continue
                i = _STRING_RUN.match(text, i).end()  # type: ignore[union-attr]
                if i == n:
                    break
                if text[i] == "\\":
                    self.escape, i = True, i + 1
                    continue
                self.in_string, i = False, i + 1  # the closing quote
                if not self.stack:
                    return i, END
                continue
            ch = text[i]
            if not self.started:
                if ch == '"':
                    self.in_string = True
                elif ch in "{[":
                    self.stack.append(ch)
                elif _scalar_char(ch):
                    self.open_scalar = True
                else:
                    return i, ERROR
                self.started, i = True, i + 1
                continue
            if self.open_scalar:
                if not _scalar_char(ch):
                    self.open_scalar = False
                    return i, END
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.stack.append(ch)
            elif ch in "}]":
                if self.stack[-1] != _CLOSER_OF[ch]:
                    return i, ERROR
                self.stack.pop()
                if not self.stack:
                    return i + 1, END
            elif not (ch.isspace() or ch in ",:" or _scalar_char(ch)):
                return i, ERROR
            i += 1
        return n, MORE


# CallObject states
_OPEN, _KEY_OR_CLOSE, _KEY, _COLON, _VALUE_START, _VALUE, _NEXT, _KEY_ONLY = range(8)


class CallObject:
    """One call written as a JSON object, keys in any order: "name" (a string), the arguments
    under the first of `args_keys` present, and with `id_key` the model's call id. Leading
    whitespace before `{` is skipped.

    The call starts (`out.start`) as soon as its name is complete, or, with `hold`, only when
    the object closes (a format whose id may follow the arguments). Arguments text is the raw
    text of the value as generated, sent as it arrives once started (held until then); an
    object that closes with a name and no arguments gets "{}". An object that closes without a
    name is not a call: END with `started` False, nothing emitted; `raw` is then its text."""

    def __init__(self, out: Emitter, *, args_keys: tuple[str, ...] = ("arguments",), id_key: str | None = None,
                 hold: bool = False, id_of: Callable[[str | None], str | None] = lambda model_id: model_id) -> None:
        self.out, self.args_keys, self.id_key, self.hold, self.id_of = out, args_keys, id_key, hold, id_of
        self.state = _OPEN
        self.started = False
        self.name: str | None = None
        self.call_id: str | None = None
        self._raw: list[str] = []  # the text consumed while not started
        self._pending: list[str] = []  # arguments text seen before the start
        self._seen: set[str] = set()  # roles already taken: the first "name"/args/id key counts
        self._role: str | None = None  # the current value's: "name", "id", "args" or None
        self._value = JsonValueScanner()
        self._value_text: list[str] = []  # the current name or id value's text

    @property
    def raw(self) -> str:
        return "".join(self._raw)

    def scan(self, text: str, pos: int = 0) -> tuple[int, int]:
        i, status = self._scan(text, pos)
        if not self.started:
            self._raw.append(text[pos:i])
        return i, status

    def _scan(self, text: str, pos: int) -> tuple[int, int]:
        i, n = pos, len(text)
        while i < n:
            st = self.state
            if st in (_KEY, _VALUE):
                j, status = self._value.scan(text, i)
                self._piece(text[i:j])
                i = j
                if status == MORE:
                    break
                if status == ERROR:
                    return i, ERROR
                if st == _KEY:
                    key = _string("".join(self._value_text))
                    if key is None:
                        return i, ERROR
                    self._role, self.state = self._role_of(key), _COLON
                elif not self._value_done():
                    return i, ERROR
                else:
                    self.state = _NEXT
                continue
            ch = text[i]
            if ch.isspace():
                i += 1
                continue
            if st == _OPEN:
                if ch != "{":
                    return i, ERROR
                self.state = _KEY_OR_CLOSE
            elif ch == "}" and st in (_KEY_OR_CLOSE, _NEXT):
                return i + 1, self._close()
            elif st in (_KEY_OR_CLOSE, _KEY_ONLY) and ch == '"':
                self._value, self._value_text, self.state = JsonValueScanner(), [], _KEY
                continue  # the scanner reads the quote
            elif st == _COLON and ch == ":":
                self.state = _VALUE_START
            elif st == _VALUE_START:
                self._value, self._value_text, self.state = JsonValueScanner(), [], _VALUE
                continue
            elif st == _NEXT and ch == ",":
                self.state = _KEY_ONLY
            else:
                return i, ERROR
            i += 1
        return n, MORE

    def _role_of(self, key: str) -> str | None:
        role = ("name" if key == "name" else "args" if key in self.args_keys
                else "id" if self.id_key is not None and key == self.id_key else None)
        if role is None or role in self._seen:
            return None
        self._seen.add(role)
        return role

    def _piece(self, piece: str) -> None:
        if self.state == _KEY or self._role in ("name", "id"):
            self._value_text.append(piece)
        elif self._role == "args":
            if self.started:
                self.out.args(piece)
            else:
                self._pending.append(piece)

    def _value_done(self) -> bool:
        """A value ended; False when it makes the object no call (a name that is no string)."""
        if self._role in ("name", "id"):
            value = _string("".join(self._value_text))
            if self._role == "id":
                self.call_id = value
            elif not value:
                return False
            else:
                self.name = value
                if not self.hold:
                    self._start()
        return True

    def _start(self) -> None:
        assert self.name is not None and not self.started
        self.started, self._raw = True, []
        self.out.start(self.name, self.id_of(self.call_id))
        self.out.args("".join(self._pending))
        self._pending = []

    def _close(self) -> int:
        if self.name is not None:
            if not self.started:
                self._start()
            if "args" not in self._seen:
                self.out.args("{}")
        return END


# CallArray states
_A_OPEN, _A_ITEM_OR_CLOSE, _A_ITEM, _A_SEP, _A_ITEM_ONLY = range(5)


class CallArray:
    """A JSON array of call objects (`[{...}, {...}]`, leading whitespace skipped), each read by
    a CallObject from `make_item`. An item that is no call is an ERROR just after it. `raw` is
    the text since the last call started (to give back as content when no call comes of it)."""

    def __init__(self, make_item: Callable[[], CallObject]) -> None:
        self.make_item = make_item
        self.state = _A_OPEN
        self.item: CallObject | None = None
        self.any_started = False
        self._own: list[str] = []  # this array's own text since the last call started

    @property
    def raw(self) -> str:
        tail = self.item.raw if self.item is not None and not self.item.started else ""
        return "".join(self._own) + tail

    def scan(self, text: str, pos: int = 0) -> tuple[int, int]:
        i, n = pos, len(text)
        while i < n:
            st = self.state
            if st == _A_ITEM:
                assert self.item is not None
                j, status = self.item.scan(text, i)
                if self.item.started:  # the text before it is now a call's, not content
                    self.any_started, self._own = True, []
                if status == MORE:
                    return n, MORE
                if status == ERROR or not self.item.started:
                    return j, ERROR
                i, self.state = j, _A_SEP
                continue
            ch = text[i]
            if ch.isspace():
                pass
            elif st == _A_OPEN and ch == "[":
                self.state = _A_ITEM_OR_CLOSE
            elif ch == "]" and st in (_A_ITEM_OR_CLOSE, _A_SEP):
                self._own.append(text[i])
                return i + 1, END
            elif st in (_A_ITEM_OR_CLOSE, _A_ITEM_ONLY) and ch == "{":
                self.item, self.state = self.make_item(), _A_ITEM
                continue
            elif st == _A_SEP and ch == ",":
                self.state = _A_ITEM_ONLY
            else:
                return i, ERROR
            self._own.append(ch)
            i += 1
        return n, MORE
