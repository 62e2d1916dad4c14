"""The Responses API's wire shapes (POST /v1/responses), as msgspec Structs: the request, the
response object, its output items and the typed stream events, with the names and fields the
official `openai` package's `types/responses` define (vLLM serves the same subset).

The request decodes like every other request here (protocol.request_decoder: unknown fields
ignored, lax coercion). Fields OpenAI defines that this server does not implement are decoded
too, as `Any`, so that serving_responses can answer a 400 naming each one that is set, rather
than dropping it silently. Output items and events are tagged Structs: msgspec writes the tag as
their `type` field, and a stream event's tag is also its SSE `event:` name.
"""
from __future__ import annotations

from typing import Any, Literal

import msgspec
from tidal.frontend.entrypoints.openai.protocol import Int64, StructuredOutputsRequest

# ----------------------------------------------------------------------------- request


class TextFormat(msgspec.Struct, kw_only=True, omit_defaults=True):
    """`text.format`: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "name", "schema", "description", "strict"} (flattened, unlike chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's models; echoed, it changes nothing here


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """`reasoning`: `effort` reaches the chat template as `reasoning_effort` (vLLM's way); a
    summary is never generated (the reasoning item's `summary` stays empty), so `summary` is
    echoed only."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    # OpenAI's fields that are implemented
    input: str | list[dict[str, Any]]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", "name": ...}
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    include: list[str] | None = None  # every value is refused: none of them is produced here
    top_logprobs: int | None = None  # echoed: logprobs come only with `include`, which is refused
    truncation: Literal["auto", "disabled"] | None = "disabled"
    metadata: dict[str, str] | None = None  # echoed and stored
    user: str | None = None  # echoed
    safety_identifier: str | None = None  # echoed
    service_tier: str | None = None  # echoed as "default": there is one tier
    prompt_cache_key: str | None = None  # a routing hint for cache hits; tidal's prefix cache is global
    stream_options: dict[str, Any] | None = None  # include_obfuscation: no obfuscation is ever sent
    # OpenAI's fields that are not implemented: a 400 naming the field when set
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    context_management: Any = None
    moderation: Any = None
    image: Any = None
    access_programs: Any = None
    background_options: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None
    # vLLM's extras, passed to the chat request as they are
    request_id: str | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool | None = None
    logit_bias: dict[str, float] | None = None
    priority: Int64 | None = None
    cache_salt: str | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = False
        if self.store is None:
            self.store = True


# ------------------------------------------------------------------------- output items


class OutputText(msgspec.Struct, tag="output_text", tag_field="type"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] | None = None  # none are produced (`include` logprobs is refused)


class ReasoningText(msgspec.Struct, tag="reasoning_text", tag_field="type"):
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(msgspec.Struct, tag="message", tag_field="type", kw_only=True):
    id: str
    role: str = "assistant"
    status: ItemStatus
    content: list[OutputText]


class ReasoningItem(msgspec.Struct, tag="reasoning", tag_field="type", kw_only=True):
    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText]
    status: ItemStatus


class FunctionCallItem(msgspec.Struct, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: ItemStatus


OutputItem = OutputMessage | ReasoningItem | FunctionCallItem
ContentPart = OutputText | ReasoningText

# ------------------------------------------------------------------------------ response


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens served from the prefix cache
    # OpenAI's count of tokens written with explicit cache retention (prompt_cache_retention),
    # which this server does not have: always 0 (tidal's prefix cache fills itself).
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int


class ResponseUsage(msgspec.Struct):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(msgspec.Struct):
    reason: str


class ResponseError(msgspec.Struct):
    code: str
    message: str


class ResponsesResponse(msgspec.Struct, kw_only=True):
    """The response object: what POST returns, what GET /v1/responses/{id} returns, and what
    the lifecycle events carry (`output` empty and `usage` None until it completes)."""

    id: str
    object: str = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"]
    background: bool = False
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: str | None = None
    service_tier: str = "default"
    store: bool = True
    temperature: float | None = None
    text: TextConfig | None = None
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    top_logprobs: int | None = None
    top_p: float | None = None
    truncation: str | None = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None


class DeleteResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


# --------------------------------------------------------------------------- stream events


class StreamEvent(msgspec.Struct, kw_only=True, tag_field="type"):
    """Every event has a `sequence_number`, numbered from 0 in the order they are sent (set
    as each is framed)."""

    sequence_number: int = 0


class ResponseCreated(StreamEvent, tag="response.created"):
    response: ResponsesResponse


class ResponseInProgress(StreamEvent, tag="response.in_progress"):
    response: ResponsesResponse


class ResponseCompleted(StreamEvent, tag="response.completed"):
    response: ResponsesResponse


class ResponseIncomplete(StreamEvent, tag="response.incomplete"):
    response: ResponsesResponse


class OutputItemAdded(StreamEvent, tag="response.output_item.added"):
    output_index: int
    item: OutputItem


class OutputItemDone(StreamEvent, tag="response.output_item.done"):
    output_index: int
    item: OutputItem


class ContentPartAdded(StreamEvent, tag="response.content_part.added"):
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class ContentPartDone(StreamEvent, tag="response.content_part.done"):
    item_id: str
    output_index: int
    content_index: int
    part: ContentPart


class OutputTextDelta(StreamEvent, tag="response.output_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class OutputTextDone(StreamEvent, tag="response.output_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDelta(StreamEvent, tag="response.reasoning_text.delta"):
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDone(StreamEvent, tag="response.reasoning_text.done"):
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDelta(StreamEvent, tag="response.function_call_arguments.delta"):
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDone(StreamEvent, tag="response.function_call_arguments.done"):
    item_id: str
    output_index: int
    name: str
    arguments: str


class ErrorEvent(StreamEvent, tag="error"):
    """A failure after the stream began (the 200 status was sent): OpenAI's `error` event."""

    code: str | None
    message: str
    param: str | None = None
