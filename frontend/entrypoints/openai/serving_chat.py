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
from tidal.frontend import content_text
from tidal.frontend import normalize_messages as normalize_chat
from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobContent,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatStreamChoiceIds,
    ChatTopLogprob,
    DeltaMessage,
    UsageChunk,
    UsageInfo,
)
from tidal.frontend.entrypoints.openai.serving_base import (
    DONE,
    ServingContext,
    SSEResponse,
    check_request,
    continuous_usage,
    final_output,
    include_usage,
    primed,
    prompt_logprobs_out,
    request_ids,
    sampling_params,
    sse,
    sse_error,
    stream_framing,
    truncated,
    until_disconnect,
    usage_tail,
)
from tidal.protocol.outputs import RequestOutput

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


def normalize_messages(messages: list[dict[str, Any]], content_format: str = "string") -> list[dict[str, Any]]:
    """chat_utils.normalize_messages, its ValueError a 400 naming `messages`."""
    try:
        return normalize_chat(messages, content_format)
    except ValueError as e:
        raise APIError(str(e), HTTPStatus.BAD_REQUEST, "messages") from None


async def render_chat(ctx: ServingContext, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                      continue_final_message: bool, kwargs: dict[str, Any] | None,
                      request_template: str | None = None, extra: dict[str, Any] | None = None) -> str:
    """The prompt text of `messages`; 400 when there is no template or it fails on them. A
    request's own template (`request_template`) needs --trust-request-chat-template; `extra`:
    apply_chat_template's `documents` and `tools`, when the request has them.
    The template renders in the server's render pool (ServingContext.in_thread): jinja2 is Python
    (100,000 messages took seconds) and the first render loads transformers' tokenizer; the
    event loop's thread keeps its share of the GIL meanwhile."""
    tok = ctx.needs_tokenizer()
    if request_template is not None and not ctx.options.trust_request_chat_template:
        raise APIError(UNTRUSTED_TEMPLATE, HTTPStatus.BAD_REQUEST, "chat_template")
    template = request_template or ctx.chat_template or getattr(tok, "chat_template", None)
    if not template:
        raise APIError(NO_TEMPLATE, HTTPStatus.BAD_REQUEST, "messages")
    if add_generation_prompt and continue_final_message:
        raise APIError("continue_final_message and add_generation_prompt cannot both be true",
                       HTTPStatus.BAD_REQUEST, "continue_final_message")
    try:
        options = ctx.options
        text = await ctx.in_thread(
            tok.apply_chat_template, normalize_messages(messages, options.content_format), chat_template=template,
            tokenize=False, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            **{**options.default_template_kwargs, **(kwargs or {}), **(extra or {})})
    except APIError:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in the template, bad kwargs
        raise APIError(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       HTTPStatus.BAD_REQUEST, "messages") from None
    return str(text)


def chat_logprobs(token_ids: list[int], positions: Any, k: int, tokenizer: Any, as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its text ("token_id:N" with `as_ids`), logprob, UTF-8
    bytes and the top `k`."""
    def text(t: int, decoded: str | None) -> str:
        return decoded if decoded is not None else tokenizer.decode([t])

    def shown(t: int, decoded: str | None) -> str:
        return f"token_id:{t}" if as_ids else text(t, decoded)

    content = []
    for token_id, pos in zip(token_ids, positions):
        chosen = pos.get(token_id) if pos else None
        decoded = chosen.decoded_token if chosen is not None else None
        top = [ChatTopLogprob(s := shown(t, lp.decoded_token), max(lp.logprob, -9999.0),
                              list(s.encode("utf-8", errors="replace")))
               for j, (t, lp) in enumerate(pos.items()) if j < k] if pos else []
        lp = max(chosen.logprob, -9999.0) if chosen is not None else -9999.0
        # `bytes` are the token's own text's, also when it is shown as "token_id:N" (vLLM's)
        content.append(ChatLogprobContent(shown(token_id, decoded), lp,
                                          list(text(token_id, decoded).encode("utf-8", errors="replace")), top))
    return ChatLogprobs(content)


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: ChatCompletionRequest, request: Request) -> Response:
        ctx = self.ctx
        model = ctx.model_name(req.model)
        check_request(req)
        if req.tool_choice not in (None, "none") and req.tools is None:
            raise APIError("When using `tool_choice`, `tools` must be set.", HTTPStatus.BAD_REQUEST, "tool_choice")
        if req.tools and req.tool_choice != "none":  # "none": the template sees them, nothing parses calls
            raise APIError("tools (function calling) are not supported by tidal; with tool_choice \"none\" the "
                           "tools only reach the chat template", HTTPStatus.BAD_REQUEST, "tools")
        if req.top_logprobs and not req.logprobs:
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.",
                           HTTPStatus.BAD_REQUEST, "top_logprobs")
        ctx.limits.check(1, req, ctx.vocab_size)
        extra = {name: value for name, value in (("documents", req.documents), ("tools", req.tools)) if value}
        text = await render_chat(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                                 continue_final_message=req.continue_final_message, kwargs=req.chat_template_kwargs,
                                 request_template=req.chat_template, extra=extra)
        ids = truncated(await ctx.encode(text, req.add_special_tokens, req.truncate_prompt_tokens, "messages"),
                        req.truncate_prompt_tokens, ctx.max_model_len)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = ctx.resolve_max_tokens(len(ids), asked)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs)
        rid, engine_rid = request_ids("chatcmpl", request, req)
        gen = ctx.engine.generate(ctx.engine_prompt(text, ids, req), params, engine_rid, priority=req.priority)
        if req.stream:
            first, gen = await until_disconnect(request, primed(gen))
            return SSEResponse(self._stream(req, rid, model, first, gen))
        final = await until_disconnect(request, final_output(gen))
        return Response(_encode(self._response(req, rid, model, final)), media_type="application/json")

    def _role(self, req: ChatCompletionRequest) -> str:
        """--response-role for a generated reply; the last message's role when the reply
        continues it (add_generation_prompt false), as vLLM."""
        if req.add_generation_prompt:
            return self.ctx.options.response_role
        return str(req.messages[-1]["role"])

    def _logprobs(self, req: ChatCompletionRequest, token_ids: list[int], positions: Any) -> ChatLogprobs | None:
        if not req.logprobs:
            return None
        return chat_logprobs(token_ids, positions or [], req.top_logprobs or 0, self.ctx.tokenizer,
                             self.ctx.tokens_as_ids(req))

    def _echoed(self, req: ChatCompletionRequest, role: str) -> str:
        """What `echo` puts before the reply: the last message's text when it has the reply's
        role (vLLM's rule), else nothing."""
        last = req.messages[-1]
        if not req.echo or last.get("role") != role:
            return ""
        return _content_text(last.get("content")) or ""

    def _response(self, req: ChatCompletionRequest, rid: str, model: str,
                  final: RequestOutput) -> ChatCompletionResponse:
        choices, completion_tokens = [], 0
        role = self._role(req)
        echoed, ids = self._echoed(req, role), req.return_token_ids
        for o in final.outputs:
            completion_tokens += len(o.token_ids)
            choices.append(ChatChoice(o.index, ChatMessage(role, echoed + o.text),
                                      self._logprobs(req, o.token_ids, o.logprobs), o.finish_reason, o.stop_reason,
                                      o.token_ids if ids else None))
        prompt_tokens = len(final.prompt_token_ids)
        usage = UsageInfo(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)
        prompt_lps = prompt_logprobs_out(final) if req.prompt_logprobs is not None else None
        return ChatCompletionResponse(id=rid, created=int(time.time()), model=model, choices=choices,
                                      usage=usage, prompt_logprobs=prompt_lps,
                                      prompt_token_ids=final.prompt_token_ids if ids else None)

    async def _stream(self, req: ChatCompletionRequest, rid: str, model: str, first: RequestOutput,
                      gen: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        with_usage = include_usage(req, self.ctx)
        continuous = with_usage and continuous_usage(req)
        prefix, suffix = stream_framing("chat.completion.chunk", rid, model, with_usage)
        prompt_tokens, completion_tokens = len(first.prompt_token_ids), 0
        choice_tokens = [0] * req.n  # per choice (continuous usage)
        # Events ready at once share one write: the role chunks with the first output, an
        # output's choices (n > 1), and the tail (the last chunk, the usage chunk and [DONE]).
        parts: list[bytes] = []
        try:
            role = self._role(req)
            echoed = self._echoed(req, role)
            # Each choice's role chunk carries the prompt's ids with return_token_ids (vLLM's place).
            start_tail = usage_tail(prompt_tokens, 0) if continuous else suffix  # both open with "]"
            role_tail = start_tail if not req.return_token_ids else (
                b'],"prompt_token_ids":' + _encode(first.prompt_token_ids) + start_tail[1:])
            for i in range(req.n):  # each choice opens with the role, as OpenAI's streams do
                parts.append(prefix + _encode(ChatStreamChoice(i, DeltaMessage(role=role, content=""))) + role_tail)
                if echoed:
                    parts.append(prefix + _encode(ChatStreamChoice(i, DeltaMessage(content=echoed))) + start_tail)
            out: RequestOutput | None = first
            while out is not None:
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                    choice = self._chunk(req, o)
                    if continuous:
                        choice_tokens[o.index] += len(o.token_ids)
                        parts.append(prefix + _encode(choice) + usage_tail(prompt_tokens, choice_tokens[o.index]))
                    else:
                        parts.append(prefix + _encode(choice) + suffix)
                if out.finished:
                    break
                if parts:
                    yield parts[0] if len(parts) == 1 else b"".join(parts)
                    parts = []
                out = await gen.__anext__()
            if with_usage:
                usage = UsageInfo(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)
                parts.append(sse(UsageChunk(rid, "chat.completion.chunk", int(time.time()), model, [], usage)))
        except Exception as e:
            parts.append(sse_error(e))
        finally:
            await gen.aclose()  # type: ignore[attr-defined]  # aborts the request if the client left
        parts.append(DONE)
        yield b"".join(parts)

    def _chunk(self, req: ChatCompletionRequest, o: Any) -> ChatStreamChoice:
        logprobs = self._logprobs(req, o.token_ids, o.logprobs)
        if req.return_token_ids:
            return ChatStreamChoiceIds(o.index, DeltaMessage(content=o.text), logprobs, o.finish_reason,
                                       o.stop_reason, o.token_ids)
        return ChatStreamChoice(o.index, DeltaMessage(content=o.text), logprobs, o.finish_reason, o.stop_reason)
