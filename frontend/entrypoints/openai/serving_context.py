"""The served model as every endpoint sees it: the engine, the names it answers to, its context
window and tokenizer (prompts tokenized and truncated by the library's PromptEncoder, as
LLM/AsyncLLM tokenize theirs), the server's chat and stream flags, and a small pool for
chat-template rendering; the parsers that split a chat reply into reasoning, content and tool
calls (reply_parser)."""
from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, TypeVar

from tidal.frontend import AsyncLLM, PromptEncoder, RequestIds, truncation_length
from tidal.frontend.entrypoints.openai.chat_tools import (
    reasoning_parser_class,
    tool_parser_class,
    tool_parser_for,
    tool_plan,
)
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.limits import RequestSizeLimits
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest, SamplingFields
from tidal.frontend.entrypoints.openai.reply import ReplyParser

if TYPE_CHECKING:
    from tidal.frontend.entrypoints.openai.reply import ReasoningParser, ToolParser

T = TypeVar("T")


@dataclass(frozen=True)
class ChatOptions:
    """tidal serve's flags for chat, completions and streams (vLLM's names: --response-role,
    --chat-template-content-format, --default-chat-template-kwargs, --enable-force-include-usage,
    --enable-prompt-tokens-details, --enable-auto-tool-choice, --tool-call-parser,
    --exclude-tools-when-tool-choice-none, --reasoning-parser)."""

    response_role: str = "assistant"
    content_format: str = "auto"  # auto and string: text parts joined; openai: a list of text parts
    default_template_kwargs: dict[str, Any] = field(default_factory=dict)
    force_include_usage: bool = False
    return_tokens_as_token_ids: bool = False  # every request's logprob tokens as "token_id:N"
    trust_request_chat_template: bool = False  # a request may bring its own chat template
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    enable_auto_tool_choice: bool = False  # tool_choice "auto" allowed (needs tool_call_parser)
    tool_call_parser: str | None = None  # the ToolParserManager name reading "auto" replies
    exclude_tools_when_tool_choice_none: bool = False  # tool_choice "none": the template sees no tools
    reasoning_parser: str | None = None  # the ReasoningParserManager name splitting off the reasoning


class ServingContext:
    """The engine and what every endpoint reads about the model it serves."""

    def __init__(self, engine: AsyncLLM, served_names: Sequence[str], chat_template: str | None,
                 options: ChatOptions | None = None, limits: RequestSizeLimits | None = None) -> None:
        self.engine = engine
        self.options = options or ChatOptions()
        self.limits = limits or RequestSizeLimits()
        self.tokenizer: Any = engine.tokenizer
        self.served_names = list(served_names)
        self.model_path: str = engine.config.model
        self.max_model_len: int = engine.model_config.max_model_len
        self.vocab_size: int = engine.info.vocab_size
        self.chat_template = chat_template
        self.encoder = None if self.tokenizer is None else PromptEncoder(self.tokenizer, self.max_model_len)
        if self.encoder is not None:
            # The size bound of long prompts, at start-up: a pass over the vocabulary, not on a
            # request's path.
            self.encoder.char_limit()
        self.request_ids = RequestIds()
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tidal-render")
        # The parser classes, resolved once (tidal serve checked the names before the engine
        # started); their modules are imported only when named.
        opts = self.options
        self.tool_parser_cls: type[ToolParser] | None = (
            tool_parser_class(opts.tool_call_parser) if opts.tool_call_parser else None)
        self.reasoning_parser_cls: type[ReasoningParser] | None = (
            reasoning_parser_class(opts.reasoning_parser) if opts.reasoning_parser else None)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def reply_parser(self, req: ChatCompletionRequest, prompt_text: str) -> ReplyParser:
        """A new parser for one choice of `req`'s reply (the request already passed
        ChatHandler.engine_inputs): the reasoning parser of --reasoning-parser, given the
        rendered prompt (with or without tools), then the tool parser its tool_choice calls for
        (chat_tools.tool_parser_for); with neither, the text passes through as content."""
        reasoning = None if self.reasoning_parser_cls is None else self.reasoning_parser_cls(prompt_text)
        return ReplyParser(reasoning, tool_parser_for(tool_plan(req, self.options), self.tool_parser_cls))

    def model_name(self, requested: str | None) -> str:
        """The name to report; 404 for a model this server does not serve."""
        if requested is None or requested == "":
            return self.served_names[0]
        if requested in self.served_names:
            return requested
        raise APIError(f"The model `{requested}` does not exist.", HTTPStatus.NOT_FOUND, "model")

    def tokens_as_ids(self, req: SamplingFields) -> bool:
        """Logprob tokens as "token_id:N": the request's choice, else the server's flag."""
        if req.return_tokens_as_token_ids is not None:
            return req.return_tokens_as_token_ids
        return self.options.return_tokens_as_token_ids

    @staticmethod
    def engine_prompt(text: str | None, ids: list[int], req: SamplingFields) -> dict[str, Any]:
        """The prompt for AsyncLLM.generate: text (kept for RequestOutput.prompt), ids, and the
        request's prefix-cache salt."""
        prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}
        if req.cache_salt is not None:
            prompt["cache_salt"] = req.cache_salt
        return prompt

    def needs_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise APIError("this endpoint needs a tokenizer (the server runs with skip_tokenizer_init)")
        return self.tokenizer

    def truncation(self, req: SamplingFields) -> int | None:
        """The prompt tokens the request's truncate_prompt_tokens keeps (truncation_length, the
        input processor's rule): its last ones, or its first with vLLM's `truncation_side:
        "right"` (a KeepFirst, which keep_last and `encode` honour); 400 naming the field for a
        value out of range. Checked before any prompt is tokenized, so a bad value costs nothing."""
        try:
            return truncation_length(req.truncate_prompt_tokens, self.max_model_len, req.truncation_side)
        except ValueError as e:
            raise APIError(str(e), HTTPStatus.BAD_REQUEST, "truncate_prompt_tokens") from None

    async def encode(self, text: str, add_special_tokens: bool, keep: int | None = None,
                     param: str | None = "prompt") -> list[int]:
        """Token ids of a prompt's text, truncated to `keep` if given (self.truncation). Long texts
        are tokenized in a worker thread (PromptEncoder.encode_async). A prompt (`param` names
        its field) that cannot fit is a 400 before it is tokenized, unless it is truncated;
        param=None: any length (/tokenize counts tokens of what may not fit)."""
        self.needs_tokenizer()
        assert self.encoder is not None  # there is a tokenizer
        try:
            return await self.encoder.encode_async(text, add_special_tokens, keep, check_fit=param is not None)
        except ValueError as e:
            raise APIError(str(e), HTTPStatus.BAD_REQUEST, param) from None

    async def in_thread(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) in the server's own small pool (chat templates): not behind long
        tokenizations in asyncio's default pool, and not on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kwargs))

    def resolve_max_tokens(self, prompt_len: int, max_tokens: int | None) -> int | None:
        """max_tokens for the engine: as asked, or what the context window leaves (None);
        400 with vLLM's message when prompt + max_tokens does not fit."""
        max_len = self.max_model_len
        if prompt_len >= max_len:  # no room for one token: vLLM's words
            raise APIError(f"This model's maximum context length is {max_len} tokens. However, your request "
                           f"has {prompt_len} input tokens. Please reduce the length of the input messages.",
                           HTTPStatus.BAD_REQUEST)
        if max_tokens is None:
            return max_tokens
        if prompt_len + max_tokens > max_len:
            raise APIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {max_len} tokens and your request has {prompt_len} input "
                f"tokens ({max_tokens} > {max_len} - {prompt_len}).", HTTPStatus.BAD_REQUEST, "max_tokens")
        return max_tokens
