"""Tool-call parsers by `--tool-call-parser` name (vLLM's names), and the two the chat route uses
for a tool_choice it enforces with structured outputs. Each is an incremental state machine
over the reply's content text (see ../reply.py for the events and the invariants every parser
keeps). Pure Python and small, so all are imported with the package."""
from __future__ import annotations

from tidal.frontend.entrypoints.openai.reply import ParserRegistry, ToolParser
from tidal.frontend.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tidal.frontend.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tidal.frontend.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from tidal.frontend.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from tidal.frontend.entrypoints.openai.tool_parsers.tool_choice import NamedToolParser, RequiredToolsParser


class ToolParserManager(ParserRegistry[ToolParser]):
    """vLLM's registry name: the classes `--tool-call-parser` chooses from."""

    kind = "tool call parser"

    @classmethod
    def get_tool_parser(cls, name: str) -> type[ToolParser]:
        return cls.get(name)


ToolParserManager.tool_parsers = ToolParserManager.table  # vLLM's attribute: the same dict
for _parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser):
    ToolParserManager.register(_parser)
ToolParserManager.register(Llama3JsonToolParser, "llama4_json")  # vLLM registers the class under both

__all__ = ["ToolParserManager", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser",
           "PythonicToolParser", "RequiredToolsParser", "NamedToolParser"]
