"""The streaming client of scripts/bench_serving.py: one /v1/completions request per
connection, read by an asyncio Protocol that de-chunks the HTTP/1.1 body, splits the
Server-Sent Events and times every read.

The client shares this machine's CPUs with the server it measures, so it is kept cheap: the
bytes are parsed in `data_received` itself (no StreamReader, no task woken per read; that
costs about half the client's CPU per event) and every event is still JSON-decoded."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import msgspec


@dataclass
class Request:
    prompt_token_ids: list[int]
    max_tokens: int


@dataclass
class Result:
    success: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


class StreamError(Exception):
    """A malformed or refused streamed response."""


class SSEParser:
    """Bytes of one HTTP/1.1 response in, `data:` payloads out. `feed` returns the payloads
    completed by these bytes; `headers` and `status` are set once the head has arrived (None
    and 0 before), and `done` once the chunked body has ended."""

    def __init__(self) -> None:
        self.headers: bytes | None = None
        self.status = 0
        self.done = False
        self._raw = b""  # bytes not yet de-chunked (or the head, until it is whole)
        self._body = b""  # de-chunked bytes not yet split into events

    def feed(self, data: bytes) -> list[bytes]:
        raw = self._raw + data
        if self.headers is None:
            end = raw.find(b"\r\n\r\n")
            if end < 0:
                self._raw = raw
                return []
            self.headers, raw = raw[:end + 4].lower(), raw[end + 4:]
            self.status = int(self.headers.split(b" ", 2)[1])
            if self.status == 200 and b"transfer-encoding: chunked" not in self.headers:
                raise StreamError("the stream is not chunked")
        if self.status != 200:
            self._raw = raw  # an error body: kept for the message, not parsed
            return []
        body, pos = self._body, 0
        while True:  # de-chunk what is complete
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                self.done = True
                break
            if len(raw) < eol + 2 + size + 2:
                break
            body += raw[eol + 2:eol + 2 + size]
            pos = eol + 2 + size + 2
        self._raw = raw[pos:]
        events = body.split(b"\n\n")
        self._body = events.pop()  # an incomplete event (or b"")
        return [e[5:].strip() for e in events if e.startswith(b"data:")]

    def has_body(self) -> bool:
        """Whether any of an error response's body has come (kept for error_text)."""
        return bool(self._raw)

    def error_text(self) -> str:
        return repr(self._raw[:300])


class _StreamProtocol(asyncio.Protocol):
    """Sends the request when connected, then parses and times what arrives; `finished` is
    set when the stream ends (or fails)."""

    def __init__(self, request: bytes, res: Result) -> None:
        self.request, self.res = request, res
        self.parser, self.decode = SSEParser(), msgspec.json.Decoder().decode
        self.finished: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.transport: asyncio.Transport | None = None
        self.last = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.last = self.res.start
        self.transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        if self.finished.done():
            return
        now, res = time.perf_counter(), self.res
        try:
            payloads = self.parser.feed(data)
            for payload in payloads:
                if payload == b"[DONE]":
                    break
                chunk = self.decode(payload)
                if chunk.get("choices"):
                    if res.ttft == 0.0:
                        res.ttft = now - res.start
                    else:
                        res.itl.append(now - self.last)
                    self.last = now
                elif usage := chunk.get("usage"):
                    res.output_tokens = usage["completion_tokens"]
        except (StreamError, ValueError, msgspec.DecodeError, KeyError, IndexError) as e:
            self.finished.set_exception(e)
            return
        if self.parser.done or (self.parser.status not in (0, 200) and self.parser.has_body()):
            self.finished.set_result(None)  # an error status: the first bytes of its body are enough

    def connection_lost(self, exc: Exception | None) -> None:
        if self.finished.done():
            return
        if self.parser.status not in (0, 200):
            self.finished.set_result(None)  # an error response, closed before its body came
        else:
            self.finished.set_exception(StreamError(f"the connection closed mid-stream ({exc})"))


async def send(host: str, port: int, path: str, auth: bytes, model: str, req: Request, temperature: float,
               timeout_s: float) -> Result:
    """One streamed completion over its own connection: a minimal HTTP/1.1 client (as vLLM's
    benchmark uses aiohttp, not httpx); every event is still read and JSON-decoded."""
    payload = msgspec.json.encode({"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
                                   "ignore_eos": True, "temperature": temperature, "stream": True,
                                   "stream_options": {"include_usage": True}})
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n").encode() + auth + b"\r\n"
    res = Result(start=time.perf_counter())  # as vLLM's benchmark: the connection's set-up counts
    proto: _StreamProtocol | None = None
    try:
        async with asyncio.timeout(timeout_s):
            _, proto = await asyncio.get_running_loop().create_connection(
                lambda: _StreamProtocol(head + payload, res), host, port)
            await proto.finished
        if proto.parser.status != 200:
            res.error = f"HTTP {proto.parser.status}: {proto.parser.error_text()}"
            return res
        res.latency = proto.last - res.start
        res.success = res.output_tokens == req.max_tokens  # ignore_eos: exactly max_tokens
        if not res.success:
            res.error = f"usage says {res.output_tokens} tokens, expected {req.max_tokens}"
    except (OSError, StreamError, ValueError, TimeoutError, msgspec.DecodeError, KeyError, IndexError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if proto is not None and proto.transport is not None:
            proto.transport.close()
    return res
