"""The one incremental parser behind every `<think>`…`</think>` reasoning format (qwen3,
deepseek_r1): the subclasses only say what a reply that does not open with the start tag is.

Where the reply starts is decided from the rendered prompt's tail, as vLLM's serving layer
does with `prompt_is_reasoning_end` (but on the tail only: a history turn's closed block is
not this reply's):
- the prompt ends with `<think>` (plus whitespace): the template opened the thinking
  (DeepSeek-R1, Qwen3 thinking models), so the reply starts inside the reasoning;
- the prompt ends with `</think>` (plus whitespace): the template closed an empty block
  (Qwen3's `enable_thinking=False`), so the whole reply is content, tags and all;
- otherwise the model opens the thinking itself or not (`reasoning_without_start_tag`).

Inside the reasoning the first `</think>` ends it; everything after is content verbatim,
including the whitespace right after the tag (vLLM's `partition`: `"\\n\\nAnswer"`), and a
later `<think>` is answer text. A reply whose `</think>` never comes (max_tokens) is all
reasoning: reasoning text is never emitted as content, the bug vLLM's qwen3 parser had.
A start tag counts only at the very start of the reply (after whitespace, which it drops);
a duplicate of the one the prompt opened is dropped the same way, as vLLM strips it.
"""
from __future__ import annotations

from enum import Enum
from typing import ClassVar

from tidal.frontend.entrypoints.openai.reply import ContentDelta, ReasoningDelta, ReasoningParser, ReplyEvent


class _Phase(Enum):
    OPENING = "opening"  # deciding whether the reply opens with the start tag
    REASONING = "reasoning"
    CONTENT = "content"


class PromptThinking(Enum):
    """What the rendered prompt's tail did to the thinking."""

    OPENED = "opened"
    CLOSED = "closed"
    NEITHER = "neither"


def prompt_thinking(prompt: str, start_tag: str, end_tag: str) -> PromptThinking:
    """OPENED when the prompt ends with `start_tag`, CLOSED with `end_tag` (whitespace after
    either allowed: templates end them with newlines), else NEITHER."""
    tail = prompt.rstrip()
    if tail.endswith(start_tag):
        return PromptThinking.OPENED
    if tail.endswith(end_tag):
        return PromptThinking.CLOSED
    return PromptThinking.NEITHER


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag` (what might
    still become the tag when more text arrives)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ThinkTagReasoningParser(ReasoningParser):
    """Splits a reply into reasoning and content at `start_tag`/`end_tag`. Holds back only
    leading whitespace plus a partial start tag at the reply's start, and a partial end tag
    at the end of the reasoning received so far; content passes straight through."""

    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # Whether a reply that does not open with start_tag (the prompt neither opened nor closed
    # the thinking) is reasoning until end_tag (deepseek_r1) or plain content (qwen3).
    reasoning_without_start_tag: ClassVar[bool]

    def __init__(self, prompt: str = "") -> None:
        super().__init__(prompt)
        self.prompt_thinking = prompt_thinking(prompt, self.start_tag, self.end_tag)
        # A closed block in the prompt: nothing to decide, the reply is content (vLLM routes
        # it past the reasoning parser).
        self._phase = _Phase.CONTENT if self.prompt_thinking is PromptThinking.CLOSED else _Phase.OPENING
        self._held = ""  # text received but not yet emitted (a possible tag's start)

    @property
    def in_reasoning(self) -> bool:
        """True while the reply may still be (or is) reasoning: structured outputs and tool
        calls apply only once this turns False."""
        return self._phase is not _Phase.CONTENT

    def _unopened_phase(self) -> _Phase:
        """The phase of a reply that turned out not to open with the start tag."""
        if self.prompt_thinking is PromptThinking.OPENED or self.reasoning_without_start_tag:
            return _Phase.REASONING
        return _Phase.CONTENT

    def feed(self, text: str) -> list[ReplyEvent]:
        if self._phase is _Phase.CONTENT:
            return [ContentDelta(text)] if text else []
        self._held += text
        if self._phase is _Phase.OPENING:
            lead = self._held.lstrip()
            if lead.startswith(self.start_tag):
                # The reply opens the thinking: drop the whitespace and the tag itself.
                self._held = lead[len(self.start_tag):]
                self._phase = _Phase.REASONING
            elif not lead or self.start_tag.startswith(lead):
                return []  # only whitespace and part of a start tag so far: undecided
            else:
                self._phase = self._unopened_phase()
                if self._phase is _Phase.CONTENT:
                    text, self._held = self._held, ""
                    return [ContentDelta(text)]
        return self._reason()

    def _reason(self) -> list[ReplyEvent]:
        """Emit the held reasoning up to the end tag (then the rest as content), keeping back
        only a suffix that may still grow into the end tag."""
        end = self._held.find(self.end_tag)
        if end >= 0:
            reasoning, rest = self._held[:end], self._held[end + len(self.end_tag):]
            self._held, self._phase = "", _Phase.CONTENT
            events: list[ReplyEvent] = [ReasoningDelta(reasoning)] if reasoning else []
            return events + ([ContentDelta(rest)] if rest else [])
        keep = _partial_suffix(self._held, self.end_tag)
        out, self._held = self._held[:len(self._held) - keep], self._held[len(self._held) - keep:]
        return [ReasoningDelta(out)] if out else []

    def finish(self) -> list[ReplyEvent]:
        held, self._held = self._held, ""
        if not held:
            return []
        if self._phase is _Phase.OPENING:
            # Ended undecided (whitespace, or an unfinished start tag): not an opening.
            self._phase = self._unopened_phase()
        # A held partial end tag in the reasoning never completed: it was reasoning text.
        return [ContentDelta(held)] if self._phase is _Phase.CONTENT else [ReasoningDelta(held)]
