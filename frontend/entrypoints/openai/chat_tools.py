"""A chat request's tools, as vLLM's serving_chat and protocol treat them: which tool_choice
values are allowed with which server flags, what the chat template sees (tools, and earlier
assistant tool calls with their arguments as dicts), the JSON schema that enforces "required"
and a named tool_choice through structured outputs, and which parsers read the reply.

tool_choice, as vLLM's:
- "none" (the default without tools): the tools reach the template unless
  --exclude-tools-when-tool-choice-none; nothing is parsed.
- "auto" (the default with tools): needs --enable-auto-tool-choice (and so --tool-call-parser);
  the server's tool parser reads the reply; any constraint of the user's own still applies.
- "required" / {"type": "function", "function": {"name": ...}}: the output is constrained to a
  JSON array of {"name", "parameters"} objects / to the named function's arguments object, so
  even a weak model returns arguments valid for the tool's schema; a constraint of the user's
  own is then a 400. Unlike vLLM (since v0.11), these need no --tool-call-parser: the format is
  the server's own, not the model's.
"""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest

if TYPE_CHECKING:
    from tidal.frontend.entrypoints.openai.reply import ReasoningParser, ToolParser
    from tidal.frontend.entrypoints.openai.serving_context import ChatOptions

AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'
TOOLS_AND_CONSTRAINT = "You can only either use constraints for structured outputs or tools, not both."
_CORRECT_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of it. `choice`: "none", "auto", "required" or "named"
    (`name` the function); `tools`: the checked tools (OpenAI's shape) or None; `template_tools`:
    what apply_chat_template gets; `schema`: the JSON schema enforcing the choice, or None."""

    choice: str
    name: str | None
    tools: list[dict[str, Any]] | None
    template_tools: list[dict[str, Any]] | None
    schema: dict[str, Any] | None


def _bad(message: str, param: str = "tool_choice") -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)


def checked_tools(tools: list[Any]) -> list[dict[str, Any]]:
    """The tools in vLLM's ChatCompletionToolsParam shape (type "function", function with
    name, description and parameters, None where absent; other keys kept, as its models keep
    extra fields); 400 naming the first bad one."""
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str) or not fn["name"]):
            raise _bad(f'tools[{i}]: expected {{"type": "function", "function": {{"name": "...", ...}}}}', "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _bad(f"tools[{i}].function.parameters: expected a JSON schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _bad(f"tools[{i}].function.description: expected a string", "tools")
        out.append({**tool, "type": "function",
                    "function": {**fn, "description": fn.get("description"), "parameters": fn.get("parameters")}})
    return out


def _named(choice: dict[str, Any]) -> str:
    """The function a named tool_choice names, checked as vLLM's check_tool_usage does."""
    function = choice.get("function")
    if choice.get("type", "function") != "function" or not isinstance(function, dict):
        raise _bad(f"Invalid value for `function`: `{function}` in `tool_choice`! {_CORRECT_USAGE}")
    if "name" not in function:
        raise _bad(f"Expected field `name` in `function` in `tool_choice`! {_CORRECT_USAGE}")
    name = function["name"]
    if not isinstance(name, str) or not name:
        raise _bad(f"Invalid `name` in `function`: `{name}` in `tool_choice`! {_CORRECT_USAGE}")
    return name


def tool_plan(req: ChatCompletionRequest, options: ChatOptions) -> ToolPlan:
    """The request's tool_choice checked against its tools and the server's flags (400s in
    vLLM's words), and what follows from it."""
    choice: Any = req.tool_choice
    tools = None if req.tools is None else checked_tools(req.tools)
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and tools is None:
        raise _bad("When using `tool_choice`, `tools` must be set.")
    if not isinstance(choice, dict) and choice not in ("none", "auto", "required"):
        raise _bad(f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or "
                   "\"required\" are supported.")
    if choice == "required" and not tools:  # OpenAI's: "required" with no tools is "none"
        return ToolPlan("none", None, None, None, None)
    assert tools is not None or choice == "none"
    name = _named(choice) if isinstance(choice, dict) else None
    if name is not None and not any(t["function"]["name"] == name for t in tools or []):
        raise _bad(f"Tool '{name}' has not been passed in `tools`.")
    if choice == "auto" and not (options.enable_auto_tool_choice and options.tool_call_parser):
        raise _bad(AUTO_NEEDS_FLAGS)
    kind = "named" if name is not None else str(choice)
    template_tools = None if (kind == "none" and options.exclude_tools_when_tool_choice_none) else tools
    schema = None
    if kind in ("required", "named"):
        assert tools is not None
        schema = tool_schema(tools, name, parallel=req.parallel_tool_calls is not False)
    return ToolPlan(kind, name, tools, template_tools, schema)


def tool_schema(tools: list[dict[str, Any]], name: str | None, *, parallel: bool = True) -> dict[str, Any]:
    """vLLM's schema for a forced choice (its _get_json_schema_from_tool): the named function's
    parameters; for "required", an array (at least one item; at most one when not `parallel`)
    of {"name": that tool's name, "parameters": its parameters}, one anyOf branch per tool, the
    tools' `$defs` hoisted to the top (so their `#/$defs/...` references resolve there). A tool
    without parameters takes an empty object. The request's own tools are left as they are
    (vLLM pops their $defs; here the template still sees them whole)."""
    params = {t["function"]["name"]: copy.deepcopy(t["function"]["parameters"]) or dict(_EMPTY_OBJECT)
              for t in tools}
    if name is not None:
        return params[name]
    defs: dict[str, Any] = {}
    for p in params.values():
        for key, value in p.pop("$defs", {}).items():
            if key in defs and defs[key] != value:
                raise _bad(f"Tool definition '{key}' has multiple schemas, which is not supported.", "tools")
            defs[key] = value
    schema: dict[str, Any] = {
        "type": "array", "minItems": 1,
        "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
             "required": ["name", "parameters"]} for n, p in params.items()]}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages as tool-calling templates expect them (vLLM's _postprocess_messages): an
    assistant turn's `tool_calls` arguments, OpenAI's JSON text, as a dict ({} when empty); an
    empty `tool_calls` list dropped, so the template takes its plain assistant path. The
    request's own messages are not changed; 400 for arguments that are not JSON."""
    out = []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if not isinstance(calls, list):
            out.append(m)
            continue
        if not calls:
            out.append({k: v for k, v in m.items() if k != "tool_calls"})
            continue
        fixed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict):
                raise _bad(f"messages[{i}].tool_calls[{j}]: expected {{\"id\", \"type\": \"function\", "
                           "\"function\": {\"name\", \"arguments\"}}", "messages")
            args = fn.get("arguments")
            if isinstance(args, str) and args:
                try:
                    args = json.loads(args)
                except json.JSONDecodeError as e:
                    raise _bad(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}",
                               "messages") from None
            elif not isinstance(args, (dict, list)):
                args = {}
            fixed.append({**call, "function": {**fn, "arguments": args}})
        out.append({**m, "tool_calls": fixed})
    return out


def _registered(manager: Any) -> list[str]:
    """The names a parser manager knows (vLLM's managers: list_registered(), or a dict)."""
    listing = getattr(manager, "list_registered", None)
    if callable(listing):
        return sorted(listing())
    for attr in ("tool_parsers", "reasoning_parsers", "parsers"):
        table = getattr(manager, attr, None)
        if isinstance(table, dict):
            return sorted(table)
    return []


def tool_parser_class(name: str) -> type[ToolParser]:
    """--tool-call-parser's class; ValueError in vLLM's words, naming the known ones."""
    from tidal.frontend.entrypoints.openai.tool_parsers import ToolParserManager

    try:
        return ToolParserManager.get_tool_parser(name)  # type: ignore[no-any-return]
    except (KeyError, ValueError):
        known = ",".join(_registered(ToolParserManager))
        raise ValueError(f"invalid tool call parser: {name} (chose from {{ {known} }})") from None


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """--reasoning-parser's class; ValueError naming the known ones."""
    from tidal.frontend.entrypoints.openai.reasoning import ReasoningParserManager

    try:
        return ReasoningParserManager.get_reasoning_parser(name)  # type: ignore[no-any-return]
    except (KeyError, ValueError):
        known = ",".join(_registered(ReasoningParserManager))
        raise ValueError(f"invalid reasoning parser: {name} (chose from {{ {known} }})") from None


def tool_parser_for(plan: ToolPlan, auto_parser: type[ToolParser] | None) -> ToolParser | None:
    """The parser that reads the reply's tool calls: the server's for "auto", the forced
    format's for "required" and a named choice, none for "none"."""
    if plan.choice == "auto":
        return None if auto_parser is None else auto_parser(plan.tools)
    if plan.choice == "required":
        from tidal.frontend.entrypoints.openai.tool_parsers import RequiredToolsParser

        return RequiredToolsParser(plan.tools)  # type: ignore[no-any-return]
    if plan.choice == "named":
        from tidal.frontend.entrypoints.openai.tool_parsers import NamedToolParser

        return NamedToolParser(plan.tools, plan.name)  # type: ignore[no-any-return]
    return None


def tool_parser_type(plan: ToolPlan, auto_parser: type[ToolParser] | None) -> type[ToolParser] | None:
    """The class tool_parser_for would build (to know its needs_special_tokens unbuilt)."""
    if plan.choice == "auto":
        return auto_parser
    if plan.choice in ("required", "named"):
        from tidal.frontend.entrypoints.openai import tool_parsers

        return tool_parsers.RequiredToolsParser if plan.choice == "required" else tool_parsers.NamedToolParser
    return None
