"""The streaming client of scripts/bench_serving.py: one /v1/completions request per
connection over a minimal HTTP/1.1 + Server-Sent Events reader, timing every event."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
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


async def _sse_events(reader: asyncio.StreamReader) -> AsyncIterator[list[bytes]]:
    """The `data:` payloads of a chunked text/event-stream body, one list per socket read (the
    events that arrived together). A plain asyncio reader and a few bytes.find calls per read:
    httpx's aiter_lines costs the client several times the server's CPU per chunk, and on a
    small box the client shares the CPUs with the server."""
    raw, body = b"", b""
    while True:
        data = await reader.read(1 << 16)
        if not data:
            raise StreamError("the connection closed mid-stream")
        raw += data
        pos, end = 0, False
        while True:  # de-chunk what is complete
            eol = raw.find(b"\r\n", pos)
            if eol < 0:
                break
            size = int(raw[pos:eol].split(b";", 1)[0], 16)
            if size == 0:
                end = True
                break
            if len(raw) < eol + 2 + size + 2:
                break
            body += raw[eol + 2:eol + 2 + size]
            pos = eol + 2 + size + 2
        raw = raw[pos:]
        events = body.split(b"\n\n")
        body = events.pop()  # an incomplete event (or b"")
        payloads = [e[5:].strip() for e in events if e.startswith(b"data:")]
        if payloads:
            yield payloads
        if end:
            return


async def send(host: str, port: int, path: str, auth: bytes, model: str, req: Request, temperature: float,
               timeout_s: float) -> Result:
    """One streamed completion over its own connection: a minimal HTTP/1.1 client (as vLLM's
    benchmark uses aiohttp, not httpx); every event is still read and JSON-decoded."""
    payload = msgspec.json.encode({"model": model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens,
                                   "ignore_eos": True, "temperature": temperature, "stream": True,
                                   "stream_options": {"include_usage": True}})
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nAccept: text/event-stream\r\n").encode() + auth + b"\r\n"
    res, decode = Result(), msgspec.json.Decoder().decode
    res.start = last = time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(head + payload)
            headers = (await reader.readuntil(b"\r\n\r\n")).lower()
            status = int(headers.split(b" ", 2)[1])
            if status != 200:
                res.error = f"HTTP {status}: {(await reader.read(300))!r}"
                return res
            if b"transfer-encoding: chunked" not in headers:
                raise StreamError("the stream is not chunked")
            async for payloads in _sse_events(reader):
                now = time.perf_counter()
                for data in payloads:
                    if data == b"[DONE]":
                        break
                    chunk = decode(data)
                    if chunk.get("choices"):
                        if res.ttft == 0.0:
                            res.ttft = now - res.start
                        else:
                            res.itl.append(now - last)
                        last = now
                    elif usage := chunk.get("usage"):
                        res.output_tokens = usage["completion_tokens"]
        res.latency = last - res.start
        res.success = res.output_tokens == req.max_tokens  # ignore_eos: exactly max_tokens
        if not res.success:
            res.error = f"usage says {res.output_tokens} tokens, expected {req.max_tokens}"
    except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, StreamError, ValueError,
            TimeoutError, msgspec.DecodeError, KeyError) as e:
        res.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    return res
