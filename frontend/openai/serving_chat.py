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
from tidal.frontend.openai.errors import APIError
from tidal.frontend.openai.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobContent,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    ChatTopLogprob,
    DeltaMessage,
    UsageChunk,
    UsageInfo,
)
from tidal.frontend.openai.serving_base import (
    DONE,
    ServingContext,
    SSEResponse,
    final_output,
    include_usage,
    new_id,
    primed,
    prompt_logprobs_out,
    sampling_params,
    sse,
    sse_error,
    stream_framing,
    truncated,
    until_disconnect,
)
from tidal.protocol.outputs import RequestOutput

_encode = msgspec.json.encode
NO_TEMPLATE = ("This model's tokenizer has no chat template, so chat completions are not available "
               "(transformers has no default chat template since v4.44). Start the server with "
               "`--chat-template FILE` (a Jinja template) or use /v1/completions.")


def _content_text(content: Any) -> str | None:
    """OpenAI content: a string, or parts of which tidal takes the text ones (joined by newlines,
    vLLM's "string" content format)."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise APIError(f"message content part of type {kind!r} is not supported (text only)",
                               HTTPStatus.BAD_REQUEST, "messages")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError("message content must be a string or a list of content parts", HTTPStatus.BAD_REQUEST,
                   "messages")


def normalize_messages(messages: list[dict[str, Any]], content_format: str = "string") -> list[dict[str, Any]]:
    """Messages as the template gets them: content as one string, or (content_format "openai")
    as OpenAI's list of text parts, a string content becoming one part."""
    if not messages:
        raise APIError("messages must hold at least one message", HTTPStatus.BAD_REQUEST, "messages")
    out = []
    for m in messages:
        if not isinstance(m.get("role"), str):
            raise APIError("every message needs a string 'role'", HTTPStatus.BAD_REQUEST, "messages")
        text = _content_text(m.get("content"))  # validates the parts (text only)
        if content_format == "openai" and text is not None:
            content: Any = ([{"type": "text", "text": p["text"]} for p in m["content"]]
                            if isinstance(m["content"], list) else [{"type": "text", "text": text}])
        else:
            content = text
        out.append({**m, "content": content})
    return out


async def render_chat(ctx: ServingContext, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                      continue_final_message: bool, kwargs: dict[str, Any] | None) -> str:
    """The prompt text of `messages`; 400 when there is no template or it fails on them.
    The template renders in the server's render pool (ServingContext.in_thread): jinja2 is Python
    (100,000 messages took seconds) and the first render loads transformers' tokenizer; the
    event loop's thread keeps its share of the GIL meanwhile."""
    tok = ctx.needs_tokenizer()
    template = ctx.chat_template or getattr(tok, "chat_template", None)
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
            **{**options.default_template_kwargs, **(kwargs or {})})
    except APIError:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in the template, bad kwargs
        raise APIError(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                       HTTPStatus.BAD_REQUEST, "messages") from None
    return str(text)


def chat_logprobs(token_ids: list[int], positions: Any, k: int, tokenizer: Any) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its text, logprob, UTF-8 bytes and the top `k`."""
    def text(t: int, decoded: str | None) -> str:
        return decoded if decoded is not None else tokenizer.decode([t])

    content = []
    for token_id, pos in zip(token_ids, positions):
        chosen = pos.get(token_id) if pos else None
        tok = text(token_id, chosen.decoded_token if chosen is not None else None)
        top = [ChatTopLogprob(s := text(t, lp.decoded_token), max(lp.logprob, -9999.0),
                              list(s.encode("utf-8", errors="replace")))
               for j, (t, lp) in enumerate(pos.items()) if j < k] if pos else []
        lp = max(chosen.logprob, -9999.0) if chosen is not None else -9999.0
        content.append(ChatLogprobContent(tok, lp, list(tok.encode("utf-8", errors="replace")), top))
    return ChatLogprobs(content)


class ChatHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def __call__(self, req: ChatCompletionRequest, request: Request) -> Response:
        ctx = self.ctx
        model = ctx.model_name(req.model)
        if req.tools:
            raise APIError("tools (function calling) are not supported by tidal", HTTPStatus.BAD_REQUEST, "tools")
        if req.top_logprobs and not req.logprobs:
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.",
                           HTTPStatus.BAD_REQUEST, "top_logprobs")
        ctx.limits.check(1, req, ctx.vocab_size)
        text = await render_chat(ctx, req.messages, add_generation_prompt=req.add_generation_prompt,
                           continue_final_message=req.continue_final_message, kwargs=req.chat_template_kwargs)
        ids = truncated(await ctx.encode(text, req.add_special_tokens, req.truncate_prompt_tokens, "messages"),
                        req.truncate_prompt_tokens, ctx.max_model_len)
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        max_tokens = ctx.resolve_max_tokens(len(ids), asked, None)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = sampling_params(req, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=req.prompt_logprobs)
        rid = new_id("chatcmpl")
        gen = ctx.engine.generate({"prompt": text, "prompt_token_ids": ids}, params, rid, priority=req.priority)
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
        return chat_logprobs(token_ids, positions or [], req.top_logprobs or 0, self.ctx.tokenizer)

    def _response(self, req: ChatCompletionRequest, rid: str, model: str,
                  final: RequestOutput) -> ChatCompletionResponse:
        choices, completion_tokens = [], 0
        for o in final.outputs:
            completion_tokens += len(o.token_ids)
            choices.append(ChatChoice(o.index, ChatMessage(self._role(req), o.text),
                                      self._logprobs(req, o.token_ids, o.logprobs), o.finish_reason, o.stop_reason))
        prompt_tokens = len(final.prompt_token_ids)
        usage = UsageInfo(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)
        prompt_lps = prompt_logprobs_out(final) if req.prompt_logprobs is not None else None
        return ChatCompletionResponse(id=rid, created=int(time.time()), model=model, choices=choices,
                                      usage=usage, prompt_logprobs=prompt_lps)

    async def _stream(self, req: ChatCompletionRequest, rid: str, model: str, first: RequestOutput,
                      gen: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        with_usage = include_usage(req, self.ctx)
        prefix, suffix = stream_framing("chat.completion.chunk", rid, model, with_usage)
        prompt_tokens, completion_tokens = len(first.prompt_token_ids), 0
        # Events ready at once share one write: the role chunks with the first output, an
        # output's choices (n > 1), and the tail (the last chunk, the usage chunk and [DONE]).
        parts: list[bytes] = []
        try:
            role = self._role(req)
            for i in range(req.n):  # each choice opens with the role, as OpenAI's streams do
                parts.append(prefix + _encode(ChatStreamChoice(i, DeltaMessage(role=role, content=""))) + suffix)
            out: RequestOutput | None = first
            while out is not None:
                for o in out.outputs:
                    completion_tokens += len(o.token_ids)
                    choice = ChatStreamChoice(o.index, DeltaMessage(content=o.text),
                                              self._logprobs(req, o.token_ids, o.logprobs),
                                              o.finish_reason, o.stop_reason)
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
