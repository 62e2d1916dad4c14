"""POST /v1/responses (OpenAI's Responses API, the subset vLLM serves), GET, DELETE and
POST .../cancel of /v1/responses/{id}.

A Responses request is made into a chat completions request (its input items into messages, its
flattened tools and text.format into chat's shapes) and then handled by the chat route's own
pieces: ChatHandler.engine_inputs renders, tokenizes and builds the SamplingParams (tool_choice
"required" and named choices enforced by structured outputs), ServingContext.reply_parser splits
the reply into reasoning, content and tool calls. So both APIs render, sample and parse alike.
The parser's events become output items here (OutputBuilder); a streamed response's typed events
and a whole one's `output` come from the same builder, so they hold the same text.

Conversations (`previous_response_id`) live in memory for the server's lifetime: the last
STORE_CAPACITY responses created with `store` (OpenAI's default: true), least recently used
evicted first; each keeps its conversation as input items, so a continuation renders the earlier
turns (their instructions excepted, as OpenAI's) and then its own input.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from http import HTTPStatus
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from tidal.frontend import random_request_id
from tidal.frontend.entrypoints.openai.disconnect import until_disconnect
from tidal.frontend.entrypoints.openai.engine_streams import final_output, primed
from tidal.frontend.entrypoints.openai.errors import APIError, from_exception
from tidal.frontend.entrypoints.openai.orca_metrics import with_orca_header
from tidal.frontend.entrypoints.openai.responses_input import chat_request, items_to_messages, refuse_unsupported
from tidal.frontend.entrypoints.openai.reply import (
    ContentDelta, ReasoningDelta, ReplyEvent, ReplyParser, ToolArgsDelta, ToolCallStart,
)
from tidal.frontend.entrypoints.openai.responses_protocol import (
    ContentPartAdded, ContentPartDone, DeleteResponse, ErrorEvent, FunctionCallArgumentsDelta,
    FunctionCallArgumentsDone, FunctionCallItem, IncompleteDetails, InputTokensDetails, OutputItem,
    OutputItemAdded, OutputItemDone, OutputMessage, OutputText, OutputTextDelta, OutputTextDone,
    OutputTokensDetails, ReasoningItem, ReasoningText, ReasoningTextDelta, ReasoningTextDone,
    ResponseCompleted, ResponseCreated, ResponseIncomplete, ResponseInProgress, ResponsesRequest,
    ResponsesResponse, ResponseUsage, StreamEvent, TextConfig, TextFormat,
)
from tidal.frontend.entrypoints.openai.server_load import ServerLoad
from tidal.frontend.entrypoints.openai.serving_chat import ChatHandler
from tidal.frontend.entrypoints.openai.sse import SSEResponse
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import SamplingParams

_encode = msgspec.json.encode
STORE_CAPACITY = 1024  # responses kept for previous_response_id and GET (a count: LRU)
_JSON = "application/json"
# The chat request's field names in the errors engine_inputs raises, as this request names them.
_PARAMS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text", "truncate_prompt_tokens": "truncation"}


def _bad(message: str, param: str | None) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)


class StoredResponse(msgspec.Struct):
    response: ResponsesResponse
    items: list[Any]  # the conversation through this response, as input items (for a continuation)


class ResponseStore:
    """The last `capacity` stored responses, least recently used evicted first. The event loop
    is its only user, so it needs no lock."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self.capacity = capacity
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, entry: StoredResponse) -> None:
        self._entries[entry.response.id] = entry
        self._entries.move_to_end(entry.response.id)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise APIError(f"Response with id '{response_id}' not found. This server keeps the last {self.capacity} "
                           "responses created with store=true, in memory, while it runs.", HTTPStatus.NOT_FOUND, param)
        self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]


class OutputBuilder:
    """A reply's events (reply.py) as Responses output items, one open at a time: consecutive
    reasoning is one reasoning item, consecutive content one message, each tool call one
    function_call item. `feed` and `close` return the stream events that build them; `items`
    holds the finished ones. `parallel` false (parallel_tool_calls): calls after the first are
    dropped, as the chat route drops them (vLLM's rule)."""

    def __init__(self, parallel: bool = True) -> None:
        self.parallel = parallel
        self.items: list[OutputItem] = []
        self.reasoning: list[str] = []  # all of the reasoning text (usage counts its tokens)
        self._open: OutputItem | None = None
        self._pieces: list[str] = []

    def feed(self, events: list[ReplyEvent]) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        index = len(self.items)
        for e in events:
            if isinstance(e, ReasoningDelta):
                if not isinstance(self._open, ReasoningItem):
                    out += self._start(ReasoningItem(id=f"rs_{random_request_id()}", content=[], status="in_progress"))
                    index = len(self.items)
                self.reasoning.append(e.text)
                self._pieces.append(e.text)
                out.append(ReasoningTextDelta(item_id=self._open.id, output_index=index, content_index=0, delta=e.text))
            elif isinstance(e, ContentDelta):
                if not isinstance(self._open, OutputMessage):
                    out += self._start(OutputMessage(id=f"msg_{random_request_id()}", status="in_progress", content=[]))
                    index = len(self.items)
                assert self._open is not None
                self._pieces.append(e.text)
                out.append(OutputTextDelta(item_id=self._open.id, output_index=index, content_index=0, delta=e.text))
            elif isinstance(e, (ToolCallStart, ToolArgsDelta)) and e.index > 0 and not self.parallel:
                continue
            elif isinstance(e, ToolCallStart):
                out += self._start(FunctionCallItem(id=f"fc_{random_request_id()}",
                                                    call_id=e.id or f"call_{random_request_id()}", name=e.name,
                                                    arguments="", status="in_progress"))
                index = len(self.items)
            elif isinstance(e, ToolArgsDelta):
                assert isinstance(self._open, FunctionCallItem)  # calls come one after another
                self._pieces.append(e.text)
                out.append(FunctionCallArgumentsDelta(item_id=self._open.id, output_index=index, delta=e.text))
        return out

    def _start(self, item: OutputItem) -> list[StreamEvent]:
        out = self.close("completed")
        self._open, self._pieces = item, []
        index = len(self.items)
        out.append(OutputItemAdded(output_index=index, item=item))
        if isinstance(item, OutputMessage):
            out.append(ContentPartAdded(item_id=item.id, output_index=index, content_index=0, part=OutputText("")))
        elif isinstance(item, ReasoningItem):
            out.append(ContentPartAdded(item_id=item.id, output_index=index, content_index=0, part=ReasoningText("")))
        return out

    def close(self, status: str) -> list[StreamEvent]:
        """The open item finished with `status` (its own events; nothing when none is open)."""
        item, text, index = self._open, "".join(self._pieces), len(self.items)
        if item is None:
            return []
        self._open, self._pieces = None, []
        out: list[StreamEvent] = []
        done: OutputItem
        if isinstance(item, OutputMessage):
            part = OutputText(text)
            out += [OutputTextDone(item_id=item.id, output_index=index, content_index=0, text=text),
                    ContentPartDone(item_id=item.id, output_index=index, content_index=0, part=part)]
            done = OutputMessage(id=item.id, status=status, content=[part])  # type: ignore[arg-type]
        elif isinstance(item, ReasoningItem):
            rpart = ReasoningText(text)
            out += [ReasoningTextDone(item_id=item.id, output_index=index, content_index=0, text=text),
                    ContentPartDone(item_id=item.id, output_index=index, content_index=0, part=rpart)]
            done = ReasoningItem(id=item.id, content=[rpart], status=status)  # type: ignore[arg-type]
        else:
            out.append(FunctionCallArgumentsDone(item_id=item.id, output_index=index, name=item.name, arguments=text))
            done = FunctionCallItem(id=item.id, call_id=item.call_id, name=item.name, arguments=text,
                                    status=status)  # type: ignore[arg-type]
        self.items.append(done)
        out.append(OutputItemDone(output_index=index, item=done))
        return out


class _Turn(msgspec.Struct):
    """One request's state between its engine inputs and its response."""

    req: ResponsesRequest
    rid: str
    model: str
    created_at: int
    params: SamplingParams
    items: list[Any]  # the conversation so far, as input items, this request's input included


class ResponsesHandler:
    def __init__(self, chat: ChatHandler, capacity: int = STORE_CAPACITY) -> None:
        self.chat, self.ctx = chat, chat.ctx
        self.store = ResponseStore(capacity)

    def routes(self, endpoint: Callable[..., Any], load: ServerLoad, max_body_bytes: int) -> list[Route]:
        """The routes; `endpoint` is the server's json_endpoint (body size, decoding, errors)."""
        create = load.tracked(with_orca_header(self.create, self.ctx.engine))
        return [Route("/v1/responses", endpoint(create, ResponsesRequest, max_body_bytes), methods=["POST"]),
                Route("/v1/responses/{response_id}", self.retrieve, methods=["GET"]),
                Route("/v1/responses/{response_id}", self.delete, methods=["DELETE"]),
                Route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])]

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        ctx = self.ctx
        refuse_unsupported(req)
        model = ctx.model_name(req.model)
        prior: list[Any] = []
        if req.previous_response_id is not None:
            prior = self.store.get(req.previous_response_id, "previous_response_id").items
        new = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else list(req.input)
        items = prior + new
        messages = items_to_messages(items, len(prior))
        if req.instructions:  # this request's own: earlier turns' instructions are not carried over
            messages.insert(0, {"role": "system", "content": req.instructions})
        chat = chat_request(req, messages, ctx.max_model_len)
        try:
            text, ids, params = await self.chat.engine_inputs(chat)
        except (APIError, ValueError) as e:  # named by the chat request's fields: renamed to this one's
            err = from_exception(e)
            err.param = _PARAMS.get(err.param or "", err.param)
            raise err from None
        given = request.headers.get("x-request-id") or req.request_id
        rid = given if given and given.startswith("resp_") else f"resp_{given or random_request_id()}"
        turn = _Turn(req, rid, model, int(time.time()), params, items)
        parser = ctx.reply_parser(chat, text)
        gen = ctx.engine.generate(ctx.engine_prompt(text, ids, chat), params, ctx.request_ids.unique(rid),
                                  priority=chat.priority)
        if req.stream:
            first, gen = await until_disconnect(request, primed(gen))
            return SSEResponse(self._stream(turn, parser, first, gen))
        final = await until_disconnect(request, final_output(gen))
        builder = OutputBuilder(req.parallel_tool_calls is not False)
        o = final.outputs[0]
        builder.feed(parser.feed(o.text) + parser.finish())
        _, response = self._finish(turn, builder, final, o.finish_reason, len(o.token_ids))
        return Response(_encode(response), media_type=_JSON)

    def _response(self, turn: _Turn, status: str, **fields: Any) -> ResponsesResponse:
        req = turn.req
        return ResponsesResponse(
            id=turn.rid, created_at=turn.created_at, status=status,  # type: ignore[arg-type]
            instructions=req.instructions, max_output_tokens=req.max_output_tokens, metadata=req.metadata or {},
            model=turn.model, parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id, reasoning=req.reasoning,
            safety_identifier=req.safety_identifier, store=bool(req.store), temperature=turn.params.temperature,
            text=req.text or TextConfig(format=TextFormat(type="text")),
            tool_choice=req.tool_choice or ("auto" if req.tools else "none"), tools=req.tools or [],
            top_logprobs=req.top_logprobs, top_p=turn.params.top_p,
            truncation=req.truncation, user=req.user, **fields)

    def _finish(self, turn: _Turn, builder: OutputBuilder, first: RequestOutput, finish_reason: str | None,
                output_tokens: int) -> tuple[list[StreamEvent], ResponsesResponse]:
        """The last item's closing events and the finished response, stored when the request
        asks. `first`: the request's first output (its prompt and prefix-cache counts)."""
        incomplete = finish_reason == "length"
        closing = builder.close("incomplete" if incomplete else "completed")
        reasoning = "".join(builder.reasoning)
        reasoning_tokens = len(self.ctx.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        input_tokens = len(first.prompt_token_ids or [])
        usage = ResponseUsage(input_tokens, InputTokensDetails(first.num_cached_tokens or 0), output_tokens,
                              OutputTokensDetails(reasoning_tokens), input_tokens + output_tokens)
        response = self._response(turn, "incomplete" if incomplete else "completed", output=builder.items,
                                  usage=usage,
                                  incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None)
        if turn.req.store:
            self.store.put(StoredResponse(response, turn.items + msgspec.to_builtins(builder.items)))
        return closing, response

    async def _stream(self, turn: _Turn, parser: ReplyParser, first: RequestOutput,
                      gen: AsyncIterator[RequestOutput]) -> AsyncIterator[bytes]:
        """The typed events, numbered in order; one write per engine output."""
        seq = 0

        def frame(events: list[StreamEvent]) -> bytes:
            nonlocal seq
            parts = []
            for ev in events:
                ev.sequence_number, seq = seq, seq + 1
                tag = type(ev).__struct_config__.tag
                parts.append(b"event: " + str(tag).encode() + b"\ndata: " + _encode(ev) + b"\n\n")
            return b"".join(parts)

        builder, tokens = OutputBuilder(turn.req.parallel_tool_calls is not False), 0
        opening = self._response(turn, "in_progress")
        head = frame([ResponseCreated(response=opening), ResponseInProgress(response=opening)])
        out: RequestOutput | None = first
        try:
            while out is not None:
                o = out.outputs[0]
                tokens += len(o.token_ids)
                events = parser.feed(o.text) if o.text else []
                if out.finished:
                    events += parser.finish()
                body = head + frame(builder.feed(events))
                head = b""
                if out.finished:
                    closing, response = self._finish(turn, builder, first, o.finish_reason, tokens)
                    end = ResponseIncomplete if response.status == "incomplete" else ResponseCompleted
                    body += frame(closing + [end(response=response)])
                    yield body
                    return
                if body:
                    yield body
                out = await anext(gen, None)
            yield frame([ErrorEvent(code="server_error", message="the engine ended the stream early")])
        except Exception as e:
            err = from_exception(e)
            yield head + frame([ErrorEvent(code=err.to_response().error.type, message=err.message, param=err.param)])
        finally:
            await gen.aclose()  # type: ignore[attr-defined]  # aborts the request if the client left

    async def retrieve(self, request: Request) -> Response:
        if request.query_params.get("stream", "false").lower() in ("true", "1"):
            raise _bad("stream=true retrieves background responses, which this server does not run", "stream")
        entry = self.store.get(request.path_params["response_id"], "response_id")
        return Response(_encode(entry.response), media_type=_JSON)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        self.store.pop(response_id)
        return Response(_encode(DeleteResponse(response_id)), media_type=_JSON)

    async def cancel(self, request: Request) -> Response:
        self.store.get(request.path_params["response_id"], "response_id")
        raise _bad("Cannot cancel a synchronous response.", "response_id")  # vLLM's words: only background ones
