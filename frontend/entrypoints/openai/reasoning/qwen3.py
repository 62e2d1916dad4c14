"""`--reasoning-parser qwen3`: Qwen3's `<think>`…`</think>`.

Qwen3's hybrid models open the thinking themselves (`<think>\\n` first in the reply) unless
the template closed an empty block (`enable_thinking=False`: all content); Qwen3 thinking
models (2507, Qwen3.5) have the template open it (the reply is reasoning up to `</think>`).
A reply that neither the prompt nor the model opened is the answer itself (a non-thinking
model, or a hybrid one answering directly), as vLLM's qwen3 parser reads a reply without
`<think>`: content, never swallowed into reasoning.
"""
from __future__ import annotations

from typing import ClassVar

from tidal.frontend.entrypoints.openai.reasoning.think_tags import ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    name: ClassVar[str] = "qwen3"
    reasoning_without_start_tag: ClassVar[bool] = False
