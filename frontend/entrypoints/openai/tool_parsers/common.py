"""What every tool parser shares: the event sink with the content rules, and marker look-ahead.

A parser is a state machine over the reply's characters. It only ever decides something from
text already seen, and when a decision needs more text (`<tool_` may still become
`<tool_call>`) it holds that text instead of guessing. So the events for a text are the same
however the text is split, and nothing emitted is ever taken back (see reply.py).
"""
from __future__ import annotations

from typing import Any

from tidal.frontend.entrypoints.openai.reply import ContentDelta, ReplyEvent, ToolArgsDelta, ToolCallStart, ToolParser


class StateMachineParser(ToolParser):
    """The loop every parser runs: text is appended to `buf`, `_run` decides what it can (and
    keeps in `buf` what it cannot yet), and at the reply's end `_end` settles what is held."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.out = Emitter()
        self.buf = ""  # text not yet decided

    def feed(self, text: str) -> list[ReplyEvent]:
        self.buf += text
        self._run()
        return self.out.take()

    def finish(self) -> list[ReplyEvent]:
        self._run()
        self._end()
        self.buf = ""
        self.out.finish()
        return self.out.take()

    def _run(self) -> None:
        raise NotImplementedError

    def _end(self) -> None:
        """The reply ended: what `buf` (and the state) still holds becomes content or is dropped."""


class Emitter:
    """Collects one parser's events and numbers its calls 0, 1, 2... in order.

    Content rule (vLLM keeps the text before a call as written, and strips around calls): the
    content is cut into segments at each call. Text before the first call is kept verbatim
    unless it is only whitespace; a segment after a call loses its leading whitespace (the
    template's newline after `</tool_call>`), so one of only whitespace is dropped. Leading
    whitespace is held until a non-space character (then it is sent with it, before any call)
    or a call (then it is dropped) decides it, which streams and non-streams alike by
    construction."""

    def __init__(self) -> None:
        self.events: list[ReplyEvent] = []
        self.calls = 0  # calls started so far; the next call's index
        self._ws = ""  # the current segment's text while it is only whitespace
        self._has_text = False  # the current segment has a non-space character

    def content(self, text: str) -> None:
        if not text:
            return
        if not self._has_text:
            if text.isspace():
                self._ws += text
                return
            text = text.lstrip() if self.calls else self._ws + text
            self._ws, self._has_text = "", True
        self._append_content(text)

    def start(self, name: str, call_id: str | None = None) -> None:
        """A call opens: the whitespace-only segment before it is dropped."""
        self._ws, self._has_text = "", False
        self.events.append(ToolCallStart(self.calls, name, call_id))
        self.calls += 1

    def args(self, text: str) -> None:
        """More arguments text of the latest call (adjacent pieces are merged)."""
        assert self.calls, "arguments before any ToolCallStart"
        if not text:
            return
        last = self.events[-1] if self.events else None
        if isinstance(last, ToolArgsDelta) and last.index == self.calls - 1:
            self.events[-1] = ToolArgsDelta(last.index, last.text + text)
        else:
            self.events.append(ToolArgsDelta(self.calls - 1, text))

    def finish(self) -> None:
        """The reply ended: a whitespace-only reply without calls is content; after a call, the
        trailing whitespace-only segment is dropped."""
        if self._ws and not self.calls:
            self._append_content(self._ws)
        self._ws = ""

    def take(self) -> list[ReplyEvent]:
        out, self.events = self.events, []
        return out

    def _append_content(self, text: str) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, ContentDelta):
            self.events[-1] = ContentDelta(last.text + text)
        else:
            self.events.append(ContentDelta(text))


def find_marker(buf: str, marker: str) -> tuple[int, bool]:
    """(n, found): `marker` starts at n in `buf` (found), or `buf[:n]` cannot be part of a marker
    and `buf[n:]` (a proper prefix of it) still may be, so it is held."""
    at = buf.find(marker)
    if at >= 0:
        return at, True
    return len(buf) - held_prefix(buf, marker), False


def held_prefix(buf: str, marker: str) -> int:
    """Length of the longest suffix of `buf` that is a proper prefix of `marker`."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


def leading_space(buf: str) -> int:
    """Length of `buf`'s leading whitespace."""
    return len(buf) - len(buf.lstrip())
