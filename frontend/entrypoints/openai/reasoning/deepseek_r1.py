"""`--reasoning-parser deepseek_r1`: DeepSeek-R1's `<think>`…`</think>` (also QwQ and the
R1 distills).

R1's templates put `<think>\\n` at the end of the generation prompt, and R1 models often skip
generating the start tag themselves, so as vLLM's deepseek_r1 parser does, the reply is
reasoning from its first character up to `</think>` whether or not `<think>` opens it; with
no `</think>` at all (max_tokens) it is all reasoning. Only a prompt that closed an empty
block (a template's no-thinking switch) makes the reply content from the start.
"""
from __future__ import annotations

from typing import ClassVar

from tidal.frontend.entrypoints.openai.reasoning.think_tags import ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    name: ClassVar[str] = "deepseek_r1"
    reasoning_without_start_tag: ClassVar[bool] = True
