"""`pythonic` (Llama 3.2/3.3/4 with vLLM's pythonic templates, ToolACE): the reply is a Python
list of calls with keyword arguments, `[get_weather(city='SF', days=3), other()]`.

As vLLM's, calls are only read when the reply starts with `[` (leading whitespace allowed here;
vLLM's would refuse it), the function is a plain name, and argument values are literals:
strings, numbers, True/False/None, lists and dicts of them (a negative number too, which vLLM
refuses). Positional arguments are ignored, as vLLM's. A call's arguments are the JSON that
json.dumps gives for its keyword arguments (vLLM's, ensure_ascii=False), sent whole when the
call's `)` closes: each call is sent as it completes.

Outcomes (the same however the text is split):
- a list that is no calls (`[1] Smith`, a markdown link, a non-literal argument) is content
  from its start, as vLLM's; once calls were sent, a broken or cut-off rest is content from
  just after the last sent call (vLLM's non-streamed parser would make the whole reply content
  and lose the calls its streaming already sent);
- text after the list's `]` is content, whitespace dropped.
"""
from __future__ import annotations

import ast
import json
import re
from typing import Any

from tidal.frontend.entrypoints.openai.tool_parsers.common import StateMachineParser, leading_space

_IDENT = re.compile(r"[A-Za-z_]\w*")
_WORD = re.compile(r"\w*")
_STRING_RUN = {"'": re.compile(r"[^'\\]*"), '"': re.compile(r'[^"\\]*')}
_CLOSER_OF = {")": "(", "]": "[", "}": "{"}
_LEAD, _ITEM_OR_CLOSE, _NAME, _ARGS, _SEP, _ITEM_ONLY, _TEXT = range(7)


def _literal(node: ast.expr) -> Any:
    """The JSON-able value of a literal argument; ValueError for anything else."""
    if isinstance(node, ast.Constant) and (node.value is None or type(node.value) in (str, int, float, bool)):
        return node.value
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd))
            and isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float)):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values):
            if not isinstance(k, ast.Constant) or type(k.value) not in (str, int, float, bool):
                raise ValueError("dict keys must be literals")
            out[k.value] = _literal(v)
        return out
    raise ValueError("arguments must be literals")


def call_arguments(text: str) -> tuple[str, str] | None:
    """(name, arguments JSON) of one call's text `name(k=v, ...)`, or None when it is none."""
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
            return None
        if any(kw.arg is None for kw in node.keywords):  # **kwargs
            return None
        args = {kw.arg: _literal(kw.value) for kw in node.keywords}
        return node.func.id, json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, RecursionError):
        return None


class PythonicToolParser(StateMachineParser):
    name = "pythonic"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.state = _LEAD
        self.raw: list[str] = []  # the text since the last sent call (all of it before one): content if it fails
        self.call: list[str] = []  # the current call's text
        self.stack: list[str] = []  # its open brackets, "(" first
        self.quote = ""  # the open string's quote character, or ""
        self.escape = False

    def _end(self) -> None:
        if self.state in (_LEAD, _TEXT):
            self.out.content(self.buf)  # whitespace only in _LEAD; nothing held in _TEXT
        else:
            self.out.content("".join(self.raw))  # a list cut off: what was not sent is content

    def _run(self) -> None:
        buf, i, n = self.buf, 0, len(self.buf)
        while i < n:
            st = self.state
            if st == _TEXT:
                self.out.content(buf[i:])
                i = n
                break
            if st == _LEAD:
                k = i + leading_space(buf[i:])
                if k == n:
                    break  # whitespace: wait (it is the list's, or the content's)
                if buf[k] != "[":
                    self.state = _TEXT
                    continue
                self.raw, self.state, i = [buf[i:k + 1]], _ITEM_OR_CLOSE, k + 1
                continue
            if st == _NAME:
                m = (_WORD if self.call else _IDENT).match(buf, i)  # the name may come in pieces
                assert m is not None
                self.call.append(m.group())
                self.raw.append(m.group())
                i = m.end()
                if i == n:
                    break
                if buf[i] != "(":
                    self._fail()
                    continue
                self.call.append("(")
                self.raw.append("(")
                self.stack, self.quote, self.escape, self.state, i = ["("], "", False, _ARGS, i + 1
                continue
            if st == _ARGS:
                j, done = self._scan_args(buf, i)
                self.call.append(buf[i:j])
                self.raw.append(buf[i:j])
                i = j
                if done is None:
                    self._fail()
                elif done:
                    parsed = call_arguments("".join(self.call))
                    if parsed is None:
                        self._fail()
                    else:
                        self.out.start(parsed[0])
                        self.out.args(parsed[1])
                        self.raw, self.state = [], _SEP
                continue
            ch = buf[i]
            if ch.isspace():
                self.raw.append(ch)
            elif st in (_ITEM_OR_CLOSE, _ITEM_ONLY) and _IDENT.match(ch):
                self.call, self.state = [], _NAME
                continue
            elif st == _SEP and ch == ",":
                self.raw.append(ch)
                self.state = _ITEM_ONLY
            elif st in (_SEP, _ITEM_ONLY) and ch == "]":  # a trailing comma is Python's too
                self.raw, self.state = [], _TEXT  # the list closed: after it, text
            else:
                self._fail()
                continue
            i += 1
        self.buf = buf[i:]

    def _fail(self) -> None:
        """The list is no (more) calls: its unsent text is content, and so is the rest."""
        self.out.content("".join(self.raw))
        self.raw, self.state = [], _TEXT

    def _scan_args(self, text: str, i: int) -> tuple[int, bool | None]:
        """Consume a call's argument text from i: (j, True) when its `)` closed at j-1,
        (len(text), False) when it goes on, (j, None) when text[j] mismatches a bracket."""
        n = len(text)
        while i < n:
            if self.quote:
                if self.escape:
                    self.escape, i = False, i + 1
                    continue
                i = _STRING_RUN[self.quote].match(text, i).end()  # type: ignore[union-attr]
                if i < n:
                    if text[i] == "\\":
                        self.escape = True
                    else:
                        self.quote = ""
                    i += 1
                continue
            ch = text[i]
            if ch in "'\"":
                self.quote = ch
            elif ch in "([{":
                self.stack.append(ch)
            elif ch in ")]}":
                if self.stack[-1] != _CLOSER_OF[ch]:
                    return i, None
                self.stack.pop()
                if not self.stack:
                    return i + 1, True
            i += 1
        return n, False
