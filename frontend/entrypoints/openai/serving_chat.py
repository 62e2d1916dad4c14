"""POST /v1/chat/completions (vLLM's serving_chat.py): the messages rendered by the chat
template (the tokenizer's own, or `--chat-template`), then one request to the engine.

Templates are rendered by transformers' `apply_chat_template(..., tokenize=False)` (jinja2 in
a sandbox, the same globals as every Hugging Face chat template expects), with the file's text
passed as `chat_template` when the server was given one.
"""
from __future__ import annotations

import time
from collections.abc import AsyncIterator
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from tidal.frontend import (
    NoChatTemplateError,
    check_chat_options,
    content_text,
    render_chat as render_chat_prompt,
    resolve_chat_template,
)
from tidal.frontend.entrypoints.openai.chat_reply import ChoiceReply, is_empty
from tidal.frontend.entrypoints.openai.chat_tools import template_messages, tool_parser_type, tool_plan
from tidal.frontend.entrypoints.openai.disconnect import until_disconnect
from tidal.frontend.entrypoints.openai.engine_streams import final_output, merged, primed
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.logprobs import chat_logprobs, prompt_logprobs_out
from tidal.frontend.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatStreamChoice,
    ChatStreamChoiceIds,
    DeltaMessage,
    UsageInfo,
)
from tidal.frontend.entrypoints.openai.request_params import check_request, request_ids, sampling_params
from tidal.frontend.entrypoints.openai.serving_context import ServingContext
from tidal.frontend.entrypoints.openai.sse import SSEResponse, StreamFraming, event_stream
from tidal.frontend.entrypoints.openai.usage_details import CachedTokens, DetailsFraming, cached_details
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import SamplingParams

_encode = msgspec.json.encode
UNTRUSTED_TEMPLATE = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
                      "Refused request with untrusted chat template.")
NO_TEMPLATE = ("This model's tokenizer has no chat template, so chat completions are not available "
               "(transformers has no default chat template since v4.44). Start the server with "
               "`--chat-template FILE` (a Jinja template) or use /v1/completions.")


def _content_text(content: Any) -> str | None:
    try:
        return content_text(content)
    except ValueError as e:
        raise APIError(str(e), HTTPStatus.BAD_REQUEST, "messages") from None


async def render_chat(ctx: ServingContext, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                      continue_final_message: bool, kwargs: dict[str, Any] | None,
                      request_template: str | None = None, extra: dict[str, Any] | None = None) -> str:
    """The prompt text of `messages`, rendered as LLM.chat renders (the library's render_chat);
    400 when there is no template or it fails on them. A request's own template
    (`request_template`) needs --trust-request-chat-template; `extra`: apply_chat_template's
    `documents` and `tools`, when the request has them.
    The template renders in the server's render pool (ServingContext.in_thread): jinja2 is Python
    (100,000 messages took seconds) and the first render loads transformers' tokenizer; the
    event loop's thread keeps its share of the GIL meanwhile."""
    tok = ctx.needs_tokenizer()
    if request_template is not None and not ctx.options.trust_request_chat_template:
        raise APIError(UNTRUSTED_TEMPLATE, HTTPStatus.BAD_REQUEST, "chat_template")
    try:
        template = resolve_chat_template(tok, request_template or ctx.chat_template)
    except NoChatTemplateError:  # the server's remedy is a flag, not LLM.chat's argument
        raise APIError(NO_TEMPLATE, HTTPStatus.BAD_REQUEST, "messages") from None
    try:
        check_chat_options(add_generation_prompt, continue_final_message)
    except ValueError as e:
        raise APIError(str(e), HTTPStatus.BAD_REQUEST, "continue_final_message") from None
    options = ctx.options
    try:
        return await ctx.in_thread(
            render_chat_prompt, tok, messages, template, content_format=options.content_format,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            template_kwargs={**options.default_template_kwargs, **(kwargs or {}), **(extra or {})})
    except ValueError as e:  # bad messages, or the template failed on them (ChatTemplateError)
        raise APIError(str(e), HTTPStatus.BAD_REQUEST, "messages") from None


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: ChatCompletionRequest, request: Request) -> Response:
        ctx = self.ctx
        model = ctx.model_name(req.model)
        text, ids, params = await self.engine_inputs(req)
        rid, engine_rid = request_ids("chatcmpl", request, req, ctx.request_ids)
        replies = [self.choice_reply(req, rid, i, text) for i in range(req.n or 1)]
        gen = ctx.engine.generate(ctx.engine_prompt(text, ids, req), params, engine_rid, priority=req.priority)
        if req.stream:
            first, gen = await until_disconnect(request, primed(gen))
            return SSEResponse(self._stream(req, rid, model, first, gen, replies))
        final = await until_disconnect(request, final_output(gen))
        return Response(_encode(self._response(req, rid, model, final, replies)), media_type="application/json")

    def choice_reply(self, req: ChatCompletionRequest, rid: str, choice: int, prompt_text: str) -> ChoiceReply:
        """Choice `choice`'s reply assembler, with its own parser (ServingContext.reply_parser)."""
        return ChoiceReply(self.ctx.reply_parser(req, prompt_text), rid, choice,
                           parallel=req.parallel_tool_calls is not False, named=isinstance(req.tool_choice, dict),
                           include_reasoning=req.include_reasoning)

    async def engine_inputs(self, req: ChatCompletionRequest) -> tuple[str, list[int], SamplingParams]:
        """The request checked, its messages rendered and tokenized, and its SamplingParams:
        (prompt text, prompt ids, params); a 400 for whatever is wrong with it. Its tools and
        tool_choice as chat_tools.tool_plan has them: the tools the template sees, and the
        constraint a forced choice puts on the output."""
        ctx = self.ctx
        check_request(req)
        plan = tool_plan(req, ctx.options)
        if req.top_logprobs and not req.logprobs:
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.",
                           HTTPStatus.BAD_REQUEST, "top_logprobs")
        ctx.limits.check(1, req, ctx.vocab_size)
        keep = ctx.truncation(req)
        extra = {name: value for name, value in (("documents", req.documents), ("tools", plan.template_tools))
                 if value}
        kwargs = req.chat_template_kwargs
        if req.reasoning_effort is not None:  # vLLM passes it to the template (gpt-oss, Qwen3.5 read it)
            kwargs = {"reasoning_effort": req.reasoning_effort, **(kwargs or {})}
        text = await render_chat(ctx, template_messages(req.messages), add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message, kwargs=kwargs,
                                 request_template=req.chat_template, extra=extra)
        ids = await ctx.encode(text, req.add_special_tokens, keep, "messages")
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = ctx.resolve_max_tokens(len(ids), asked)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        # A parser whose markers are special tokens needs them in the text (vLLM's rule).
        tool_cls = tool_parser_type(plan, ctx.tool_parser_cls)
        special = any(cls is not None and cls.needs_special_tokens for cls in (tool_cls, ctx.reasoning_parser_cls))
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs,
                                 tool_schema=plan.schema, skip_special_tokens=False if special else None)
        return text, ids, params

    def role(self, req: ChatCompletionRequest) -> str:
        """--response-role for a generated reply; the last message's role when the reply
        continues it (add_generation_prompt false), as vLLM."""
        if req.add_generation_prompt:
            return self.ctx.options.response_role
        return str(req.messages[-1]["role"])

    def logprobs(self, req: ChatCompletionRequest, token_ids: list[int], positions: Any) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return chat_logprobs(token_ids, positions or [], req.top_logprobs or 0, self.ctx.tokenizer,
                             self.ctx.tokens_as_ids(req))

    def echoed(self, req: ChatCompletionRequest, role: str) -> str:
        """What `echo` puts before the reply: the last message's text when it has the reply's
        role (vLLM's rule), else nothing."""
        last = req.messages[-1]
        if not req.echo or last.get("role") != role:
            return ""
        return _content_text(last.get("content")) or ""

    def _response(self, req: ChatCompletionRequest, rid: str, model: str, final: RequestOutput,
                  replies: list[ChoiceReply]) -> ChatCompletionResponse:
        choices, completion_tokens = [], 0
        role = self.role(req)
        echoed, ids = self.echoed(req, role), req.return_token_ids
        for o in final.outputs:
            completion_tokens += len(o.token_ids)
            reply = replies[o.index]
            choices.append(ChatChoice(o.index, reply.message(role, o.text, echoed),
                                      self.logprobs(req, o.token_ids, o.logprobs), reply.finish_reason(o.finish_reason),
                                      o.stop_reason, o.token_ids if ids else None))
        prompt_tokens = len(final.prompt_token_ids)
        usage = UsageInfo(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens,
                          cached_details(self.ctx.options.prompt_tokens_details, final.num_cached_tokens))
        prompt_lps = prompt_logprobs_out(final) if req.prompt_logprobs is not None else None
        return ChatCompletionResponse(id=rid, created=int(time.time()), model=model, choices=choices,
                                      usage=usage, prompt_logprobs=prompt_lps,
                                      prompt_token_ids=final.prompt_token_ids if ids else None)

    def _stream(self, req: ChatCompletionRequest, rid: str, model: str, first: RequestOutput,
                gen: AsyncIterator[RequestOutput], replies: list[ChoiceReply]) -> AsyncIterator[bytes]:
        options = self.ctx.options
        framing = DetailsFraming("chat.completion.chunk", rid, model, req, options.force_include_usage)
        usage = UsageInfo(prompt_tokens=len(first.prompt_token_ids))
        cached = CachedTokens(options.prompt_tokens_details)
        choice_tokens = [0] * req.n  # per choice (continuous usage)
        # Without parsers the text is the content, chunk for chunk (no events to assemble).
        plain = all(r.parser.reasoning is None and r.parser.tools is None for r in replies)
        # An output whose text the parsers hold back still has a chunk when it carries per-token data.
        per_token = bool(req.logprobs or req.return_token_ids)
        opened = False

        def events(item: tuple[int, RequestOutput]) -> tuple[list[bytes], bool]:
            nonlocal opened
            out = item[1]
            parts = [] if opened else self._opening(req, framing, first)  # with the first output's: one write
            opened = True
            cached.see(0, out.num_cached_tokens, usage)
            for o in out.outputs:
                usage.completion_tokens += len(o.token_ids)
                choice_tokens[o.index] += len(o.token_ids)
                if plain:
                    delta, finish = DeltaMessage(content=o.text), o.finish_reason
                else:
                    reply, last = replies[o.index], o.finish_reason is not None
                    delta = reply.delta(reply.events(o.text, last))
                    finish = reply.finish_reason(o.finish_reason)
                    if not last and not per_token and is_empty(delta):
                        continue
                parts.append(framing.chunk(self._chunk(req, o, delta, finish), usage.prompt_tokens,
                                           choice_tokens[o.index]))
            return parts, out.finished

        return event_stream(merged([(first, gen)]), events, framing, usage)

    def _opening(self, req: ChatCompletionRequest, framing: StreamFraming, first: RequestOutput) -> list[bytes]:
        """Each choice opens with the role, as OpenAI's streams do, then the echoed text if any;
        the role chunk carries the prompt's ids with return_token_ids (vLLM's place)."""
        role = self.role(req)
        echoed = self.echoed(req, role)
        start_tail = framing.tail(len(first.prompt_token_ids), 0)  # opens with "]"
        role_tail = start_tail if not req.return_token_ids else (
            b'],"prompt_token_ids":' + _encode(first.prompt_token_ids) + start_tail[1:])
        parts = []
        for i in range(req.n):
            parts.append(framing.prefix + _encode(ChatStreamChoice(i, DeltaMessage(role=role, content=""))) + role_tail)
            if echoed:
                parts.append(framing.prefix + _encode(ChatStreamChoice(i, DeltaMessage(content=echoed))) + start_tail)
        return parts

    def _chunk(self, req: ChatCompletionRequest, o: Any, delta: DeltaMessage, finish: str | None) -> ChatStreamChoice:
        logprobs = self.logprobs(req, o.token_ids, o.logprobs)
        if req.return_token_ids:
            return ChatStreamChoiceIds(o.index, delta, logprobs, finish, o.stop_reason, o.token_ids)
        return ChatStreamChoice(o.index, delta, logprobs, finish, o.stop_reason)
