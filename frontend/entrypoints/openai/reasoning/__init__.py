"""Reasoning parsers by `--reasoning-parser` name (vLLM's names): each splits a reply into
ReasoningDelta and ContentDelta events (see reply.py). The parsers are pure Python and tiny,
so all are imported with the package."""
from __future__ import annotations

from tidal.frontend.entrypoints.openai.reasoning.deepseek_r1 import DeepSeekR1ReasoningParser
from tidal.frontend.entrypoints.openai.reasoning.qwen3 import Qwen3ReasoningParser
from tidal.frontend.entrypoints.openai.reasoning.think_tags import ThinkTagReasoningParser
from tidal.frontend.entrypoints.openai.reply import ParserRegistry, ReasoningParser


class ReasoningParserManager(ParserRegistry[ReasoningParser]):
    """vLLM's registry name: the classes `--reasoning-parser` chooses from."""

    kind = "reasoning parser"

    @classmethod
    def get_reasoning_parser(cls, name: str) -> type[ReasoningParser]:
        return cls.get(name)


ReasoningParserManager.reasoning_parsers = ReasoningParserManager.table  # vLLM's attribute: the same dict
ReasoningParserManager.register(Qwen3ReasoningParser)
ReasoningParserManager.register(DeepSeekR1ReasoningParser)

__all__ = ["ReasoningParserManager", "ThinkTagReasoningParser", "Qwen3ReasoningParser", "DeepSeekR1ReasoningParser"]
