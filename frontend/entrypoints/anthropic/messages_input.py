"""An Anthropic Messages request as the chat completions request that does its work (vLLM's way:
its AnthropicServingMessages converts to a ChatCompletionRequest too), so the chat route's
ChatHandler.engine_inputs renders, tokenizes and builds the SamplingParams, and
ServingContext.reply_parser splits the reply: both APIs render, sample and parse alike.

- system (a string or text blocks) is the first message, a system one; Claude Code's
  `x-anthropic-billing-header` block is dropped, as vLLM drops it (a per-request hash in the
  prompt's first tokens would defeat prefix caching).
- user turns: text blocks are content parts; each tool_result block is a "tool" message (before
  the turn's text, as the tool results answer the previous assistant turn).
- assistant turns: text blocks are content, tool_use blocks are tool calls (input as JSON text),
  thinking blocks are `reasoning_content` (what chat templates read); redacted_thinking is dropped.
- a last assistant turn is continued, as Anthropic's API continues it (a "prefill").
- tools: input_schema is the function's parameters; tool_choice auto/any/tool/none are chat's
  "auto"/"required"/named/"none" (forced ones enforced by structured outputs);
  disable_parallel_tool_use is parallel_tool_calls false.
Anything else is a 400 naming it.
"""
from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

import msgspec
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest
from tidal.frontend.entrypoints.anthropic.protocol import ConversationFields, MessagesRequest

BILLING_HEADER = "x-anthropic-billing-header"
# Anthropic fields this server has no feature for: set (not null), each is a 400 naming it.
UNSUPPORTED = ("container", "mcp_servers", "context_management", "diagnostics", "inference_geo",
               "user_profile_id", "workspace_id")
# vLLM's sampling extras the request may carry (in the anthropic client's extra_body), passed on.
PASSED = ("temperature", "top_p", "top_k", "seed", "ignore_eos", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "priority", "cache_salt", "structured_outputs")
# Roles recent Claude Code versions send besides Anthropic's (vLLM maps them to "user" too).
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "ctx": "user", "msg": "user"}


def _bad(message: str, param: str | None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)


def refuse_unsupported(req: ConversationFields) -> None:
    for name in UNSUPPORTED:
        if getattr(req, name) is not None:
            raise _bad(f"`{name}` is not supported by this server", name)
    if req.speed not in (None, "standard"):
        raise _bad(f"`speed` {req.speed!r} is not supported by this server (only \"standard\")", "speed")
    if isinstance(req, MessagesRequest) and req.service_tier not in (None, "auto", "standard_only"):
        raise _bad(f"`service_tier` {req.service_tier!r} is not supported by this server", "service_tier")


def _texts(blocks: list[dict[str, Any]], where: str, *, drop_billing: bool = False) -> list[str]:
    """The text of text blocks; any other block is a 400 naming it."""
    out = []
    for j, block in enumerate(blocks):
        kind = block.get("type")
        text = block.get("text")
        if kind != "text" or not isinstance(text, str):
            raise _bad(f"{where}[{j}]: content blocks of type {kind!r} are not supported here (text only)",
                       where.split("[", 1)[0].split(".", 1)[0])
        if not (drop_billing and text.startswith(BILLING_HEADER)):
            out.append(text)
    return out


def _parts(texts: list[str]) -> str | list[dict[str, Any]]:
    """Chat content: one text as a string, several as text parts."""
    if len(texts) == 1:
        return texts[0]
    return [{"type": "text", "text": t} for t in texts]


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_texts(content, f"{where}.content"))
    elif not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or text blocks", "messages")
    return {"role": "tool", "tool_call_id": block.get("tool_use_id") or "", "content": content}


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    name, args = block.get("name"), block.get("input", {})
    if not isinstance(name, str) or not isinstance(args, dict):
        raise _bad(f"{where}: a tool_use block needs a string `name` and an object `input`", "messages")
    return {"id": block.get("id") or "", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def _turn(role: str, blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    """One turn's blocks as chat messages: its tool results, then the turn itself (if it has
    anything besides them)."""
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    thinking: list[str] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            texts.append(block["text"])
        elif kind == "tool_result" and role == "user":
            results.append(_tool_result(block, at))
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
            thinking.append(block["thinking"])
        elif kind == "redacted_thinking" and role == "assistant":
            continue  # opaque (encrypted) by design: nothing a template could show
        elif kind in ("tool_result", "tool_use", "thinking"):
            raise _bad(f"{at}: a {kind} block cannot be in a {role} message", "messages")
        else:
            raise _bad(f"{at}: content blocks of type {kind!r} are not supported by this server "
                       "(text, tool_use, tool_result and thinking are)", "messages")
    if not (texts or calls or thinking):
        return results
    message: dict[str, Any] = {"role": role, "content": _parts(texts) if texts else ("" if role != "assistant"
                                                                                     or not calls else None)}
    if calls:
        message["tool_calls"] = calls
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    return [*results, message]


def chat_messages(req: ConversationFields) -> list[dict[str, Any]]:
    """The request's system prompt and turns as chat messages."""
    system: list[str] = []
    if isinstance(req.system, str):
        system.append(req.system)
    elif req.system is not None:
        system += _texts(req.system, "system", drop_billing=True)
    messages: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        role = _ROLES.get(m.role)
        if role is None:
            raise _bad(f"messages[{i}].role: {m.role!r} is not one of \"user\", \"assistant\"", "messages")
        if role == "system":  # a system turn among the messages joins the system prompt (vLLM's way)
            system += [m.content] if isinstance(m.content, str) else _texts(m.content, f"messages[{i}].content")
        elif isinstance(m.content, str):
            messages.append({"role": role, "content": m.content})
        else:
            messages += _turn(role, m.content, f"messages[{i}]")
    if not messages:
        raise _bad("messages: at least one user or assistant message is needed", "messages")
    if system:
        messages.insert(0, {"role": "system", "content": _parts(system)})
    return messages


def _tools(req: ConversationFields) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(req.tools or []):
        if tool.type not in (None, "custom") or tool.input_schema is None:
            raise _bad(f"tools[{i}]: tools of type {tool.type!r} are not supported by this server (only client "
                       "tools with an `input_schema`; server tools run on Anthropic's servers)", "tools")
        out.append({"type": "function", "function": {"name": tool.name, "description": tool.description,
                                                     "parameters": {"type": "object", **tool.input_schema}}})
    return out


def _tool_choice(req: ConversationFields) -> str | dict[str, Any] | None:
    choice = req.tool_choice
    if choice is None:
        return None  # chat's default: "auto" with tools, else "none"
    if choice.type == "tool":
        if not choice.name:
            raise _bad("tool_choice.name is required when tool_choice.type is \"tool\"", "tool_choice")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def chat_request(req: ConversationFields, *, count_only: bool = False, keep_auto: bool = True
                 ) -> ChatCompletionRequest:
    """The chat completions request that does `req`'s work. max_tokens is left to the caller
    (serving_messages caps it at what the context window leaves). `count_only`
    (count_tokens) with `keep_auto` false (a server without --enable-auto-tool-choice, whose
    "none" still shows the template the tools): a tool_choice "auto" it could not run still
    counts, as "none", which renders the same prompt."""
    refuse_unsupported(req)
    messages = chat_messages(req)
    chat: dict[str, Any] = {"model": req.model, "messages": messages}
    if messages[-1]["role"] == "assistant" and "tool_calls" not in messages[-1]:
        chat.update(add_generation_prompt=False, continue_final_message=True)  # Anthropic's prefill
    if req.tools:
        chat["tools"] = _tools(req)
    choice = _tool_choice(req)
    if count_only and not keep_auto and req.tools and choice in (None, "auto"):
        choice = "none"
    chat["tool_choice"] = choice
    if req.tool_choice is not None and req.tool_choice.disable_parallel_tool_use:
        chat["parallel_tool_calls"] = False
    if req.chat_template_kwargs is not None:
        chat["chat_template_kwargs"] = req.chat_template_kwargs
    out = req.output_config
    if out is not None and out.effort is not None:
        chat["reasoning_effort"] = out.effort
    if not count_only:
        assert isinstance(req, MessagesRequest)
        chat.update(stream=bool(req.stream), stop=req.stop_sequences)
        chat.update({name: value for name in PASSED if (value := getattr(req, name)) is not None})
        if out is not None and out.format is not None:
            chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output",
                                                                              "schema": out.format.json_schema}}
    try:
        return msgspec.convert(chat, ChatCompletionRequest, strict=False)
    except msgspec.ValidationError as e:
        raise _bad(str(e), None) from None
