"""Anthropic Messages API schemas (POST /v1/messages, /v1/messages/count_tokens) as msgspec
Structs, with the field names and shapes of the `anthropic` package's types.

Requests are decoded leniently, as the chat route's are (protocol.request_decoder): unknown
fields are ignored. Content blocks stay dicts here: serving_messages converts each by its `type`
and answers a 400 naming the block it does not serve (images, documents, server tools).
Fields Anthropic defines whose features this server lacks are declared, so that setting one is
a 400 naming it rather than silently ignored (serving_messages.refuse_unsupported). Responses
and stream events are tagged Structs: `type` is the tag, encoded first, as Anthropic's.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

from tidal.frontend.entrypoints.openai.protocol import Int64

# ----------------------------------------------------------------------------- requests


class Message(msgspec.Struct, kw_only=True):
    """One turn: a string, or content blocks (text, tool_use, tool_result, thinking, ...)."""

    role: str
    content: str | list[dict[str, Any]]


class Tool(msgspec.Struct, kw_only=True):
    """A client tool (`type` absent or "custom"); Anthropic's server tools (web_search_...,
    bash_..., a dated `type`) have no input_schema and are refused by name."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None


class ToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    """Accepted: a --reasoning-parser splits the thinking off whatever this says; the budget is
    not enforced (the model's template decides whether it thinks)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    json_schema: dict[str, Any] = msgspec.field(name="schema")


class OutputConfig(msgspec.Struct, kw_only=True):
    effort: str | None = None  # passed to the chat template as reasoning_effort (vLLM's way)
    format: OutputFormat | None = None  # enforced by structured outputs


class ConversationFields(msgspec.Struct, kw_only=True):
    """What both routes take: the conversation and what renders it."""

    model: str
    messages: list[Message]
    system: str | list[dict[str, Any]] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted and ignored: Claude Code sends it on every request; prefix caching is automatic.
    cache_control: dict[str, Any] | None = None
    # Anthropic's, for features this server lacks: a 400 naming the one set.
    speed: str | None = None
    container: Any = None
    mcp_servers: Any = None
    context_management: Any = None
    diagnostics: Any = None
    inference_geo: str | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # vLLM's extra (its AnthropicMessagesRequest has it too)
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(ConversationFields, kw_only=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # Accepted and ignored: a user id for the provider's abuse tracking; no tiers here.
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None
    # vLLM's sampling extras (as the chat route's), sent by clients in extra_body
    seed: Int64 | None = None
    ignore_eos: bool | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    priority: Int64 | None = None
    cache_salt: str | None = None
    structured_outputs: dict[str, Any] | None = None


class CountTokensRequest(ConversationFields, kw_only=True):
    pass


# ---------------------------------------------------------------------------- responses


class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ThinkingBlock(msgspec.Struct, tag="thinking", tag_field="type"):
    thinking: str
    # Anthropic's is a proof of its own model's thinking; here an opaque random token, so clients
    # that require one (and send the block back) work.
    signature: str


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlock = Union[TextBlock, ThinkingBlock, ToolUseBlock]


class Usage(msgspec.Struct):
    input_tokens: int
    output_tokens: int


class MessagesResponse(msgspec.Struct, kw_only=True, tag="message", tag_field="type"):
    id: str
    role: str = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: Usage


class CountTokensResponse(msgspec.Struct):
    input_tokens: int


class ErrorBody(msgspec.Struct):
    type: str
    message: str


class ErrorResponse(msgspec.Struct, tag="error", tag_field="type"):
    """`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`; also the
    stream's `error` event."""

    error: ErrorBody


# ------------------------------------------------------------------------ stream events


class MessageStart(msgspec.Struct, tag="message_start", tag_field="type"):
    message: MessagesResponse


class ContentBlockStart(msgspec.Struct, tag="content_block_start", tag_field="type"):
    index: int
    content_block: ContentBlock


class TextDelta(msgspec.Struct, tag="text_delta", tag_field="type"):
    text: str


class ThinkingDelta(msgspec.Struct, tag="thinking_delta", tag_field="type"):
    thinking: str


class SignatureDelta(msgspec.Struct, tag="signature_delta", tag_field="type"):
    signature: str


class InputJsonDelta(msgspec.Struct, tag="input_json_delta", tag_field="type"):
    partial_json: str


BlockDelta = Union[TextDelta, ThinkingDelta, SignatureDelta, InputJsonDelta]


class ContentBlockDelta(msgspec.Struct, tag="content_block_delta", tag_field="type"):
    index: int
    delta: BlockDelta


class ContentBlockStop(msgspec.Struct, tag="content_block_stop", tag_field="type"):
    index: int


class StopInfo(msgspec.Struct):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDelta(msgspec.Struct, tag="message_delta", tag_field="type"):
    delta: StopInfo
    usage: Usage  # totals (the client overwrites its counts with them)


class MessageStop(msgspec.Struct, tag="message_stop", tag_field="type"):
    pass


class Ping(msgspec.Struct, tag="ping", tag_field="type"):
    pass


StreamEvent = Union[MessageStart, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta,
                    MessageStop, Ping, ErrorResponse]
