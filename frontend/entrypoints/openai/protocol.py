"""Request and response schemas of the OpenAI-compatible server, as msgspec Structs.

Requests are decoded straight into typed Structs (`request_decoder`: msgspec, strict=False):
unknown fields are ignored, as OpenAI clients send fields this server does not know; values
are coerced where vLLM's pydantic models (lax mode) coerce them (a numeric string for a
number, "true"/"false"/"1"/"0" or 0/1 for a bool, an int for a float, 5.0 for an int), and a
wrong type is a 400 naming the field. The bounds vLLM puts on fields (pydantic `Field(ge=...,
le=...)`) are msgspec `Meta` constraints here, answered in pydantic's words (errors.py).
Responses and stream chunks are Structs too, encoded by msgspec without building Python dicts
per token. Field names and order follow vLLM's protocol.py (OpenAI's names plus vLLM's
extras, e.g. `stop_reason`).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec

# vLLM's bounds (pydantic Field(ge=..., le=...) in its request models): a seed and a priority
# are 64-bit signed; truncate_prompt_tokens is -1 (the context window) or a count.
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, msgspec.Meta(ge=INT64_MIN, le=INT64_MAX)]
TruncatePromptTokens = Annotated[int, msgspec.Meta(ge=-1, le=INT64_MAX)]

T = TypeVar("T")

# ----------------------------------------------------------------------------- requests


def request_decoder(request_type: type[T]) -> msgspec.json.Decoder[T]:
    """The decoder of a request body into `request_type`, lenient where vLLM is (see above)."""
    return msgspec.json.Decoder(request_type, strict=False)

class StreamOptions(msgspec.Struct):
    """vLLM's (`include_usage: bool | None = False`, `continuous_usage_stats: bool | None =
    False`): each is false unless sent true, so `{}` asks for no usage chunk. UNSET tells `{}`
    (which vLLM takes without `stream`: its check is the object's truthiness) from options
    actually set. sse.should_include_usage reads them as vLLM does."""

    include_usage: bool | None | msgspec.UnsetType = msgspec.UNSET
    continuous_usage_stats: bool | None | msgspec.UnsetType = msgspec.UNSET

    @property
    def given(self) -> bool:
        return self.include_usage is not msgspec.UNSET or self.continuous_usage_stats is not msgspec.UNSET

    @property
    def usage(self) -> bool:
        return self.include_usage is True

    @property
    def continuous(self) -> bool:
        """Usage in every chunk, when usage is included at all (see sse.should_include_usage)."""
        return self.continuous_usage_stats is True


class JsonSchemaResponseFormat(msgspec.Struct, kw_only=True):
    name: str = ""
    description: str | None = None
    json_schema: dict[str, Any] | None = msgspec.field(default=None, name="schema")  # OpenAI's key
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True):
    """OpenAI's response_format (and vLLM's structural_tag form, legacy or `format`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaResponseFormat | None = None
    # type "structural_tag": xgrammar's `format` object, or the legacy structures + triggers
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None


class StructuredOutputsRequest(msgspec.Struct, kw_only=True):
    """vLLM's `structured_outputs` body field: StructuredOutputsParams' fields."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None
    max_whitespace_cnt: int | None = None  # tidal's: whitespace bound of JSON grammars (None: the engine's)


class SamplingFields(msgspec.Struct, kw_only=True):
    """What both generation endpoints take: OpenAI's fields and vLLM's extras. A field vLLM
    types Optional takes an explicit null as its default (clients that send every field do)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    # vLLM's: the side truncate_prompt_tokens cuts ("right" keeps the first N tokens, "left" the
    # last N); None is its generation tokenizers' side, "left".
    truncation_side: Literal["left", "right"] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    priority: Int64 = 0
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    # vLLM's request extras: the id the response reports, token ids in the response,
    # logprob tokens as "token_id:N", the prefix-cache salt; and two refused (see request_params.check_request)
    request_id: str | None = None
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    cache_salt: str | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search's only
    logits_processors: list[Any] | None = None

    def __post_init__(self) -> None:
        if self.stream is None:
            self.stream = False


class CompletionRequest(SamplingFields, kw_only=True):
    # str | list[str] | list[int] | list[list[int]]: one JSON-array type in a msgspec union,
    # so the list forms are told apart by `completion_prompts`.
    prompt: str | list[Any] | None = None
    max_tokens: int | None = 16  # OpenAI's (and vLLM's) default for completions
    echo: bool | None = False
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.echo is None:
            self.echo = False


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    n: int | None = 1  # Optional in vLLM's chat request (not in its completions request)
    max_tokens: int | None = None  # deprecated by OpenAI for max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    echo: bool = False  # the reply starts with the last message's content when it has its role
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False  # the template writes the special tokens itself
    chat_template: str | None = None  # with --trust-request-chat-template only
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, str]] | None = None  # passed to the template (RAG), as vLLM
    # Tools, as OpenAI's: [{"type": "function", "function": {"name", "description", "parameters"}}];
    # tool_choice "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}},
    # None: "auto" with tools, else "none" (vLLM's check_tool_usage). Checked in chat_tools.py.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = True  # false: at most one call
    include_reasoning: bool = True  # false: the reasoning parser's text is dropped from the reply
    reasoning_effort: str | None = None  # passed to the chat template, as vLLM

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.n is None:
            self.n = 1
        if self.logprobs is None:
            self.logprobs = False


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's /tokenize: a completion `prompt` or chat `messages`."""

    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]


# ---------------------------------------------------------------------------- responses


class PromptTokenUsageInfo(msgspec.Struct):
    """vLLM's usage.prompt_tokens_details (--enable-prompt-tokens-details)."""
    cached_tokens: int | None = None


class UsageInfo(msgspec.Struct):
    prompt_tokens: int = 0
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class PromptLogprob(msgspec.Struct):
    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionStreamChoiceIds(CompletionStreamChoice):
    """A chunk's choice with return_token_ids: the new ids, and the prompt's in the first."""

    token_ids: list[int] = msgspec.field(default_factory=list)
    prompt_token_ids: list[int] | None = None


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprobContent(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprobContent] | None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object's text, as OpenAI's


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class ChatMessage(msgspec.Struct):
    """`content` None when the reply is only tool calls (OpenAI's shape). The reasoning is sent
    under both names clients read: `reasoning_content` (vLLM's until v0.11, DeepSeek's API,
    LangChain) and `reasoning` (vLLM's since)."""

    role: str
    content: str | None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None  # the call's first delta only
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, omit_defaults=True):
    """A piece of call `index`: id, type and name in its first delta only; later ones carry
    `index` and argument text (OpenAI's wire format: absent, never null)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    """Only the fields a chunk sets (the first of a choice: the role, then content); a field
    with nothing new is absent, never null."""

    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatStreamChoiceIds(ChatStreamChoice):
    """A chunk's choice with return_token_ids: the new ids."""

    token_ids: list[int] = msgspec.field(default_factory=list)


class StreamHeader(msgspec.Struct):
    """A stream's constant leading fields; its chunks are this header's JSON (less the closing
    brace) + the choice + the tail, so only the choice is encoded per chunk."""

    id: str
    object: str
    created: int
    model: str


class UsageChunk(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: UsageInfo


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "tidal"
    root: str
    parent: str | None = None
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str
