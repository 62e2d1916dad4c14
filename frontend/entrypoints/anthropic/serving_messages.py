"""POST /v1/messages and POST /v1/messages/count_tokens: Anthropic's Messages API, as vLLM serves it.

A request becomes a chat completions request (messages_input.chat_request) that the chat route's
own pieces run: ChatHandler.engine_inputs renders, tokenizes and builds the SamplingParams,
ServingContext.reply_parser splits the reply into reasoning, content and tool calls. The
parser's events become content blocks here (BlockBuilder): a `thinking` block for reasoning,
`text` for content, one `tool_use` per call. A streamed reply's events and a whole one's
`content` come from the same builder, so they hold the same blocks.

The stream is Anthropic's: message_start, ping, then per block content_block_start, its
content_block_delta events (text_delta / thinking_delta + signature_delta / input_json_delta)
and content_block_stop, then message_delta (stop_reason, stop_sequence, usage) and
message_stop; an error after the stream started is an `error` event. Errors before it are
Anthropic's `{"type": "error", "error": {"type", "message"}}` with the HTTP status.

max_tokens (required by Anthropic, so clients send large ones: Claude Code 32,000) is capped at
what the model's context window leaves after the prompt, rather than refused as chat's is; a
reply cut there has stop_reason "model_context_window_exceeded", Anthropic's name for it.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tidal.frontend import random_request_id
from tidal.frontend.entrypoints.anthropic.messages_input import chat_request
from tidal.frontend.entrypoints.anthropic.protocol import (
    BlockDelta, ContentBlock, ContentBlockDelta, ContentBlockStart, ContentBlockStop, CountTokensRequest,
    CountTokensResponse, ErrorBody, ErrorResponse, InputJsonDelta, MessageDelta, MessagesRequest,
    MessagesResponse, MessageStart, MessageStop, Ping, SignatureDelta, StopInfo, StreamEvent, TextBlock,
    TextDelta, ThinkingBlock, ThinkingDelta, ToolUseBlock, Usage,
)
from tidal.frontend.entrypoints.openai.disconnect import until_disconnect
from tidal.frontend.entrypoints.openai.engine_streams import final_output, primed
from tidal.frontend.entrypoints.openai.errors import APIError, from_exception
from tidal.frontend.entrypoints.openai.orca_metrics import with_orca_header
from tidal.frontend.entrypoints.openai.protocol import ChatCompletionRequest
from tidal.frontend.entrypoints.openai.reply import (
    ContentDelta, ReasoningDelta, ReplyEvent, ReplyParser, ToolArgsDelta, ToolCallStart,
)
from tidal.frontend.entrypoints.openai.server_load import ServerLoad
from tidal.frontend.entrypoints.openai.serving_chat import ChatHandler
from tidal.frontend.entrypoints.openai.sse import SSEResponse
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import SamplingParams

_encode = msgspec.json.encode
_JSON = "application/json"
# Anthropic's error type for each status (its `anthropic` client's exception classes follow the status).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}
# The chat request's field names in the errors engine_inputs raises, as this API names them.
_PARAMS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens", "response_format": "output_config",
           "reasoning_effort": "output_config", "parallel_tool_calls": "tool_choice"}


def error_body(e: APIError) -> bytes:
    """`e` in Anthropic's shape, which has no `param`: the message names the field instead
    ("max_tokens: ...", as Anthropic's own errors do) when it does not already."""
    kind = ERROR_TYPES.get(int(e.status), "api_error")
    message = e.message if not e.param or e.param in e.message else f"{e.param}: {e.message}"
    return _encode(ErrorResponse(ErrorBody(kind, message)))


def error_response(e: APIError) -> Response:
    return Response(error_body(e), status_code=int(e.status), media_type=_JSON, headers=e.headers or None)


def anthropic_errors(endpoint: Callable[[Request], Awaitable[Response]]) -> Callable[[Request], Awaitable[Response]]:
    """The server's json_endpoint with its errors (413, 400 for a body that does not decode, the
    handler's) answered in Anthropic's shape instead of OpenAI's."""

    async def run(request: Request) -> Response:
        try:
            return await endpoint(request)
        except Exception as e:
            return error_response(from_exception(e))

    return run


def _sse(event: StreamEvent) -> bytes:
    tag = type(event).__struct_config__.tag
    return b"event: " + str(tag).encode() + b"\ndata: " + _encode(event) + b"\n\n"


class BlockBuilder:
    """A reply's events (reply.py) as content blocks, one open at a time: consecutive reasoning
    is one thinking block, consecutive content one text block, each tool call one tool_use
    block. `feed` and `close` return the stream events that build them; `blocks` holds the
    finished ones. Content that is only whitespace (between a model's tool calls) opens no block;
    it is kept for a text block that follows. `parallel` false: calls after the first are dropped."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.blocks: list[ContentBlock] = []
        self.called = False
        self._open: ContentBlock | None = None
        self._pieces: list[str] = []
        self._blank = ""  # whitespace-only content not yet in a block

    def feed(self, events: list[ReplyEvent]) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        for e in events:
            if isinstance(e, (ToolCallStart, ToolArgsDelta)) and e.index > 0 and not self.parallel:
                continue
            if isinstance(e, ReasoningDelta) and e.text:
                if not isinstance(self._open, ThinkingBlock):
                    out += self._start(ThinkingBlock("", ""))
                out.append(self._delta(ThinkingDelta(e.text), e.text))
            elif isinstance(e, ContentDelta) and e.text:
                if not isinstance(self._open, TextBlock):
                    if not (self._blank + e.text).strip():
                        self._blank += e.text
                        continue
                    text = self._blank + e.text
                    out += self._start(TextBlock(""))
                else:
                    text = e.text
                out.append(self._delta(TextDelta(text), text))
            elif isinstance(e, ToolCallStart):
                self.called = True
                out += self._start(ToolUseBlock(e.id or f"toolu_{random_request_id()}", e.name, {}))
            elif isinstance(e, ToolArgsDelta) and e.text:
                assert isinstance(self._open, ToolUseBlock)  # a call's arguments follow its start
                out.append(self._delta(InputJsonDelta(e.text), e.text))
        return out

    def _delta(self, delta: BlockDelta, text: str) -> ContentBlockDelta:
        self._pieces.append(text)
        return ContentBlockDelta(len(self.blocks), delta)

    def _start(self, block: ContentBlock) -> list[StreamEvent]:
        out = self.close()
        self._open, self._pieces, self._blank = block, [], ""
        return [*out, ContentBlockStart(len(self.blocks), block)]

    def close(self) -> list[StreamEvent]:
        """The open block finished (its closing events; nothing when none is open)."""
        block, text, index = self._open, "".join(self._pieces), len(self.blocks)
        if block is None:
            return []
        self._open, self._pieces = None, []
        out: list[StreamEvent] = []
        done: ContentBlock
        if isinstance(block, TextBlock):
            done = TextBlock(text)
        elif isinstance(block, ThinkingBlock):
            done = ThinkingBlock(text, random_request_id())
            out.append(ContentBlockDelta(index, SignatureDelta(done.signature)))
        else:
            done = ToolUseBlock(block.id, block.name, _arguments(text))
        self.blocks.append(done)
        out.append(ContentBlockStop(index))
        return out


def _arguments(text: str) -> dict[str, Any]:
    """A call's arguments as the object tool_use.input must be; {} when the reply was cut
    before they were whole (max_tokens), as a client could not run them anyway."""
    try:
        value = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass
class _Turn:
    """One request's state between its engine inputs and its response."""

    rid: str
    model: str
    capped: bool  # max_tokens was capped at the context window's room


def stop_info(turn: _Turn, builder: BlockBuilder, finish_reason: str | None, engine_stop: int | str | None
              ) -> StopInfo:
    """Anthropic's stop_reason (and the stop sequence matched) for the engine's finish."""
    if finish_reason == "length":
        return StopInfo("model_context_window_exceeded" if turn.capped else "max_tokens", None)
    if builder.called:
        return StopInfo("tool_use", None)
    if isinstance(engine_stop, str):  # a stop string matched (a stop token id is an int)
        return StopInfo("stop_sequence", engine_stop)
    return StopInfo("end_turn", None)


class MessagesHandler:
    def __init__(self, chat: ChatHandler) -> None:
        self.chat, self.ctx = chat, chat.ctx

    def routes(self, endpoint: Callable[..., Any], load: ServerLoad, max_body_bytes: int) -> list[Route]:
        """The routes; `endpoint` is the server's json_endpoint (body size, decoding, errors)."""
        create = load.tracked(with_orca_header(self.create, self.ctx.engine))
        return [Route("/v1/messages", anthropic_errors(endpoint(create, MessagesRequest, max_body_bytes)),
                      methods=["POST"]),
                Route("/v1/messages/count_tokens",
                      anthropic_errors(endpoint(self.count_tokens, CountTokensRequest, max_body_bytes)),
                      methods=["POST"])]

    async def _inputs(self, req: MessagesRequest | CountTokensRequest) -> tuple[ChatCompletionRequest, str, list[int], SamplingParams]:
        """(chat request, prompt text, prompt ids, SamplingParams), errors named as this API names fields."""
        ctx = self.ctx
        options = ctx.options
        chat = chat_request(req, count_only=isinstance(req, CountTokensRequest),
                            keep_auto=bool(options.enable_auto_tool_choice and options.tool_call_parser)
                            or options.exclude_tools_when_tool_choice_none)
        try:
            text, ids, params = await self.chat.engine_inputs(chat)
        except APIError as e:
            e.param = _PARAMS.get(e.param or "", e.param)
            raise
        return chat, text, ids, params

    async def count_tokens(self, req: CountTokensRequest, request: Request) -> Response:
        self.ctx.model_name(req.model)
        _, _, ids, _ = await self._inputs(req)
        return Response(_encode(CountTokensResponse(len(ids))), media_type=_JSON)

    async def create(self, req: MessagesRequest, request: Request) -> Response:
        ctx = self.ctx
        model = ctx.model_name(req.model)
        chat, text, ids, params = await self._inputs(req)
        # engine_inputs left max_tokens to the context window (the chat request has none): cap here.
        room = ctx.max_model_len - len(ids)
        params.max_tokens = min(req.max_tokens, room)
        given = request.headers.get("x-request-id")
        turn = _Turn(f"msg_{given or random_request_id()}", model, req.max_tokens > room)
        parser = ctx.reply_parser(chat, text)
        parallel = chat.parallel_tool_calls is not False
        gen = ctx.engine.generate(ctx.engine_prompt(text, ids, chat), params, ctx.request_ids.unique(turn.rid),
                                  priority=chat.priority)
        if req.stream:
            first, gen = await until_disconnect(request, primed(gen))
            return SSEResponse(self._stream(turn, parser, BlockBuilder(parallel), first, gen))
        final = await until_disconnect(request, final_output(gen))
        o = final.outputs[0]
        builder = BlockBuilder(parallel)
        builder.feed(parser.feed(o.text) + parser.finish())
        builder.close()
        response = MessagesResponse(id=turn.rid, content=builder.blocks, model=model,
                                    **msgspec.structs.asdict(stop_info(turn, builder, o.finish_reason, o.stop_reason)),
                                    usage=Usage(len(final.prompt_token_ids or []), len(o.token_ids)))
        return Response(_encode(response), media_type=_JSON)

    async def _stream(self, turn: _Turn, parser: ReplyParser, builder: BlockBuilder, first: RequestOutput,
                      gen: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        """The events; one write per engine output (its events joined)."""
        usage = Usage(len(first.prompt_token_ids or []), 0)
        opening = MessagesResponse(id=turn.rid, content=[], model=turn.model, usage=Usage(usage.input_tokens, 0))
        head = _sse(MessageStart(opening)) + _sse(Ping())
        out: RequestOutput | None = first
        try:
            while out is not None:
                o = out.outputs[0]
                usage.output_tokens += len(o.token_ids)
                events = parser.feed(o.text) if o.text else []
                if out.finished:
                    events += parser.finish()
                body = head + b"".join(_sse(ev) for ev in builder.feed(events))
                head = b""
                if out.finished:
                    closing: list[StreamEvent] = [*builder.close(), MessageDelta(
                        stop_info(turn, builder, o.finish_reason, o.stop_reason), usage), MessageStop()]
                    yield body + b"".join(_sse(ev) for ev in closing)
                    return
                if body:
                    yield body
                out = await anext(gen, None)
            yield _sse(ErrorResponse(ErrorBody("api_error", "the engine ended the stream early")))
        except Exception as e:
            err = from_exception(e)
            yield head + _sse(ErrorResponse(ErrorBody(ERROR_TYPES.get(int(err.status), "api_error"), err.message)))
        finally:
            await gen.aclose()  # type: ignore[attr-defined]  # aborts the request if the client left
