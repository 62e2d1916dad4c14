"""A Responses API request as the chat completions request that does its work: its input items
as messages, its flattened function tools and tool_choice in chat's shapes, text.format as
response_format, vLLM's sampling extras passed on; and the 400 for each field whose feature this
server does not have (serving_responses runs the chat request through ChatHandler)."""
from __future__ import annotations

from http import HTTPStatus
from typing import Any

import msgspec
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest
from tidal.frontend.entrypoints.openai.responses_protocol import ResponsesRequest

# Fields OpenAI defines whose features this server does not have: set, each is a 400 naming it.
UNSUPPORTED = ("conversation", "prompt", "max_tool_calls", "context_management", "moderation", "image",
               "access_programs", "background_options", "prompt_cache_options", "prompt_cache_retention")
# vLLM's extra sampling fields, passed to the chat request as they are.
PASSED = ("seed", "stop", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
          "ignore_eos", "logit_bias", "priority", "cache_salt", "skip_special_tokens",
          "include_stop_str_in_output", "chat_template_kwargs")
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


def _bad(message: str, param: str | None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)


def refuse_unsupported(req: ResponsesRequest) -> None:
    """400 naming the first field set whose feature is not served."""
    if req.background:
        raise _bad("background mode is not supported by this server (responses run while the request is open)",
                   "background")
    for name in UNSUPPORTED:
        if getattr(req, name) is not None:
            raise _bad(f"`{name}` is not supported by this server", name)
    if req.include:
        raise _bad(f"`include` values {req.include} are not supported by this server (it returns no logprobs, "
                   "encrypted reasoning or built-in tool results)", "include")


def _content(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat's: a string, or its text parts (input_text, output_text,
    refusal); any other part (images, files, audio) is a 400 naming it."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where}.content must be a string or a list of content parts", "input")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        text = part.get("refusal" if kind == "refusal" else "text") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text", "text", "refusal") or not isinstance(text, str):
            raise _bad(f"{where}.content[{j}]: content of type {kind!r} is not supported (text only)", "input")
        parts.append({"type": "text", "text": text})
    return parts


def items_to_messages(items: list[Any], first_new: int = 0) -> list[dict[str, Any]]:
    """Responses input items as chat messages: a message (any role; "developer" as "system"),
    a function_call (an assistant tool call, joining the assistant turn just before it), a
    function_call_output (a tool message); reasoning items are left out (vLLM's way). Errors
    name the item by its index in this request's `input` (items before `first_new` were stored)."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i - first_new}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and isinstance(item, dict) and item.get("role") in _ROLES:
            messages.append({"role": _ROLES[item["role"]], "content": _content(item.get("content"), where)})
        elif kind == "function_call":
            assert isinstance(item, dict)
            name, args = item.get("name"), item.get("arguments", "")
            if not isinstance(name, str) or not isinstance(args, str):
                raise _bad(f"{where}: a function_call needs a string `name` and `arguments`", "input")
            call = {"id": item.get("call_id") or item.get("id"), "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            assert isinstance(item, dict)
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": _content(item.get("output"), where)})
        elif kind == "reasoning":
            continue
        elif kind == "message":
            raise _bad(f"{where}: a message's role must be one of {sorted(_ROLES)}", "input")
        else:
            raise _bad(f"{where}: input items of type {kind!r} are not supported by this server", "input")
    return messages


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Responses' flattened function tools in chat's shape; any other type is a 400."""
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _bad(f"tools[{i}]: tools of type {kind!r} are not supported by this server (only \"function\"; "
                       "built-in tools such as web_search run on OpenAI's servers)", "tools")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                          "strict") if k in tool}})
    return out


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return choice  # None, "none", "auto", "required" (others: chat_tools' 400)
    if choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _bad(f"tool_choice {choice} is not supported (only \"none\", \"auto\", \"required\" or "
               "{\"type\": \"function\", \"name\": ...})", "tool_choice")


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]], max_model_len: int) -> ChatCompletionRequest:
    """The chat completions request that does `req`'s work."""
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise _bad(f"max_output_tokens must be at least 1, got {req.max_output_tokens}", "max_output_tokens")
    chat: dict[str, Any] = {"messages": messages, "model": req.model, "max_completion_tokens": req.max_output_tokens,
                            "temperature": req.temperature, "top_p": req.top_p, "stream": req.stream,
                            "tool_choice": _tool_choice(req.tool_choice),
                            "parallel_tool_calls": req.parallel_tool_calls}
    if req.tools:
        chat["tools"] = _tools(req.tools)
    chat.update({name: value for name in PASSED if (value := getattr(req, name)) is not None})
    if req.reasoning is not None and req.reasoning.effort is not None:
        chat["reasoning_effort"] = req.reasoning.effort
    if req.truncation == "auto":  # the prompt's last tokens, leaving room for the output (vLLM keeps the last)
        chat["truncate_prompt_tokens"] = max(1, max_model_len - (req.max_output_tokens or 1))
    fmt = req.text.format if req.text is not None else None
    if req.structured_outputs is not None:
        if fmt is not None and fmt.type != "text":
            raise _bad("Cannot specify both structured_outputs and text.format", "structured_outputs")
        chat["structured_outputs"] = msgspec.to_builtins(req.structured_outputs)
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise _bad("text.format of type json_schema needs a `schema`", "text")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "schema": fmt.json_schema, "description": fmt.description,
            "strict": fmt.strict}}
        # vLLM's options for text.format: compact JSON, no properties beyond the schema's
        chat["structured_outputs"] = {"disable_any_whitespace": True, "disable_additional_properties": True}
    try:
        return msgspec.convert(chat, ChatCompletionRequest, strict=False)
    except msgspec.ValidationError as e:
        raise _bad(str(e), None) from None
