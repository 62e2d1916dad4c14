"""Server-sent events: the framing of stream chunks, the stream skeleton both streamed endpoints
(completions, chat) run, and the response that writes it.

A chunk is `data: ` + the stream's constant header (id, object, created, model) + the encoded
choice + a tail, so only the choice is encoded per token. Events ready at once share one write:
an output's choices (n > 1), and the stream's tail (its last chunk, the usage chunk, [DONE]).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send
from tidal.frontend.entrypoints.openai.disconnect import wait_disconnect
from tidal.frontend.entrypoints.openai.errors import ErrorResponse, from_exception
from tidal.frontend.entrypoints.openai.protocol import (
    SamplingFields,
    StreamHeader,
    StreamOptions,
    UsageChunk,
    UsageInfo,
)

T = TypeVar("T")
DONE = b"data: [DONE]\n\n"
_encode = msgspec.json.encode


def sse(obj: msgspec.Struct) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def sse_error(e: BaseException) -> bytes:
    """An error after the stream started: one `data: {"error": ...}` event (vLLM's way)."""
    error: ErrorResponse = from_exception(e).to_response()
    return sse(error)


def should_include_usage(stream_options: StreamOptions | None, force_include_usage: bool) -> tuple[bool, bool]:
    """(a usage chunk ends the stream, every chunk carries the usage so far), as vLLM's function
    of that name decides (vllm/entrypoints/serve/utils/api_utils.py): --enable-force-include-usage
    turns both on, whatever the request says; else `stream_options.include_usage` (false unless
    sent true, `{}` included), and `continuous_usage_stats` only along with it. A whole
    (non-streamed) response always carries its usage, with the flag or without."""
    if force_include_usage:
        return True, True
    if stream_options is None:
        return False, False
    include_usage = stream_options.usage
    return include_usage, include_usage and stream_options.continuous


class StreamFraming:
    """One stream's chunk framing and usage reporting: `data: {"id":...,"choices":[` before a
    chunk's encoded choice; after it `]}` (`],"usage":null}` when the stream ends with a usage
    chunk, as OpenAI's), or the usage so far with continuous_usage_stats."""

    def __init__(self, obj: str, request_id: str, model: str, req: SamplingFields, force_usage: bool) -> None:
        self.obj, self.request_id, self.model = obj, request_id, model
        self.with_usage, self.continuous = should_include_usage(req.stream_options, force_usage)
        header = _encode(StreamHeader(request_id, obj, int(time.time()), model))
        self.prefix = b"data: " + header[:-1] + b',"choices":['
        self.suffix = b'],"usage":null}\n\n' if self.with_usage else b"]}\n\n"

    def tail(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """What closes a chunk (it opens with "]"): the usage so far (continuous_usage_stats)
        or the plain suffix."""
        if not self.continuous:
            return self.suffix
        usage = UsageInfo(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)
        return b'],"usage":' + _encode(usage) + b"}\n\n"

    def chunk(self, choice: msgspec.Struct, prompt_tokens: int, completion_tokens: int) -> bytes:
        """One choice's event (the counts: its usage so far, for continuous_usage_stats)."""
        return self.prefix + _encode(choice) + self.tail(prompt_tokens, completion_tokens)

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        """The stream's closing usage event (with_usage)."""
        total = UsageInfo(usage.prompt_tokens, usage.prompt_tokens + usage.completion_tokens, usage.completion_tokens)
        return sse(UsageChunk(self.request_id, self.obj, int(time.time()), self.model, [], total))


async def event_stream(outputs: AsyncIterator[T], events: Callable[[T], tuple[list[bytes], bool]],
                       framing: StreamFraming, usage: UsageInfo) -> AsyncIterator[bytes]:
    """The body of a streamed response: `events(item)` gives each engine output's events and
    whether it was the stream's last; `usage` is what they counted. Each output's events are one
    write; the last output's go with the usage chunk and [DONE] in one. An error mid-stream is
    one error event before [DONE] (the status was sent already); `outputs` is closed at the end,
    which aborts its requests if the client left."""
    parts: list[bytes] = []
    try:
        async for item in outputs:
            batch, last = events(item)
            parts += batch
            if last:
                break
            if parts:
                yield parts[0] if len(parts) == 1 else b"".join(parts)
                parts = []
        if framing.with_usage:
            parts.append(framing.usage_chunk(usage))
    except Exception as e:
        parts.append(sse_error(e))
    finally:
        await outputs.aclose()  # type: ignore[attr-defined]
    parts.append(DONE)
    yield b"".join(parts)


class SSEResponse(StreamingResponse):
    """An event stream, sent straight to the server's `send` (Starlette's StreamingResponse runs
    it in an anyio task group per response). The body generator yields bytes, each one or more
    whole `data: ...\n\n` events ready at once, so each is one write; the piece ending in
    `data: [DONE]` ends the body in that same write. A watcher task cancels the stream when the
    client disconnects, and the generator is closed as soon as the response ends (not when it is
    garbage-collected), which aborts its requests now."""

    media_type = "text/event-stream"

    async def _send_all(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        async for chunk in self.body_iterator:
            if chunk.endswith(DONE):  # the last event: finish the body in the same write
                await send({"type": "http.response.body", "body": chunk, "more_body": False})
                return
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream = asyncio.ensure_future(self._send_all(send))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        try:
            await asyncio.wait((stream, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not stream.done():  # the client left, or this task was cancelled (shutdown)
                stream.cancel()
                await asyncio.gather(stream, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[attr-defined]
        if not stream.cancelled() and (exc := stream.exception()) is not None and not isinstance(exc, OSError):
            raise exc
