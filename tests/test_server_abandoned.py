"""Requests whose client is gone (issue 31, abandoned requests): the server's outermost ASGI
layer (disconnect.CancelOnDisconnect) cancels a request's work at its client's disconnect
wherever that work is -- rendering, tokenizing, waiting for the engine -- and a request whose
client is already gone when the handler would hand it to the engine is never handed over.

These drive the middleware with an ASGI app and server channel of the test's own, so what
happens at each moment of a disconnect is fixed, not left to timing; the end-to-end storm
against `tidal serve` is in test_server_lifecycle.py (it shares that module's server)."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.requests import Request

from tidal.frontend.entrypoints.openai.disconnect import (
    CancelOnDisconnect,
    ClientGone,
    client_gone,
    until_disconnect,
)

BODY = {"type": "http.request", "body": b"{}", "more_body": False}
DISCONNECT = {"type": "http.disconnect"}


class Channel:
    """The ASGI server's side: receive() gives the body, then waits until `disconnect()`."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self.queue.put_nowait(BODY)
        self.sent: list[dict[str, Any]] = []

    async def receive(self) -> dict[str, Any]:
        return await self.queue.get()

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def disconnect(self) -> None:
        self.queue.put_nowait(DISCONNECT)


SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}


class Handler:
    """A handler's shape: read the body, do slow front-end work (`render`, released by the
    test), then hand the request to the engine through until_disconnect (`submitted`)."""

    def __init__(self) -> None:
        self.render = asyncio.Event()
        self.rendering = asyncio.Event()
        self.submitted: list[str] = []
        self.cancelled = False

    async def engine_work(self) -> str:
        self.submitted.append("request")
        return "output"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        await request.body()
        self.rendering.set()
        try:
            await self.render.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        try:
            out = await until_disconnect(request, self.engine_work())
        except ClientGone:
            await send({"type": "http.response.start", "status": 499, "headers": []})
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": out.encode()})


async def _run(app: Any, channel: Channel) -> asyncio.Task[None]:
    return asyncio.ensure_future(CancelOnDisconnect(app)(dict(SCOPE), channel.receive, channel.send))


async def _ended(task: asyncio.Task[None]) -> None:
    """The request's task ends by itself within 5 s (not cancelled by the wait), raising nothing."""
    await asyncio.wait({task}, timeout=5)
    assert task.done(), "the request's task is still running"
    task.result()


@pytest.mark.asyncio
async def test_disconnect_during_front_end_work_cancels_it_and_nothing_reaches_the_engine() -> None:
    handler, channel = Handler(), Channel()
    task = await _run(handler, channel)
    await asyncio.wait_for(handler.rendering.wait(), 5)
    channel.disconnect()  # the client leaves while its chat template is being rendered
    await _ended(task)  # quietly: nobody is there to answer
    assert handler.cancelled and handler.submitted == [] and channel.sent == []


@pytest.mark.asyncio
async def test_client_gone_before_the_hand_over_is_never_handed_over() -> None:
    """The disconnect is known to the server but the listener has not run yet (the handler
    never yielded since): until_disconnect still sees it, and the engine gets nothing."""
    channel = Channel()
    seen: list[bool] = []
    submitted: list[str] = []

    async def engine_work() -> str:
        submitted.append("request")
        return "output"

    async def app(scope: Any, receive: Any, send: Any) -> None:
        request = Request(scope, receive)
        await request.body()
        channel.disconnect()  # arrives while the handler works without yielding
        seen.append(client_gone(request))
        try:
            await until_disconnect(request, engine_work())
        except ClientGone:
            await send({"type": "http.response.start", "status": 499, "headers": []})
            await send({"type": "http.response.body", "body": b""})

    await _ended(await _run(app, channel))
    assert seen == [True] and submitted == []
    assert [m.get("status") for m in channel.sent if m["type"] == "http.response.start"] == [499]


@pytest.mark.asyncio
async def test_a_client_that_stays_gets_its_response_and_a_late_disconnect_cancels_nothing() -> None:
    handler, channel = Handler(), Channel()
    task = await _run(handler, channel)
    await asyncio.wait_for(handler.rendering.wait(), 5)
    handler.render.set()
    await _ended(task)
    assert handler.submitted == ["request"] and not handler.cancelled
    assert channel.sent[-1] == {"type": "http.response.body", "body": b"output"}
    channel.disconnect()  # the connection closes after the response: nothing left to cancel
    await asyncio.sleep(0.05)
    assert channel.queue.qsize() == 1  # the listener was stopped with the response


@pytest.mark.asyncio
async def test_a_server_cancel_is_not_swallowed() -> None:
    """The server's own cancel (its shutdown) still propagates: only a cancel made because the
    client left ends the request quietly."""
    handler, channel = Handler(), Channel()
    task = await _run(handler, channel)
    await asyncio.wait_for(handler.rendering.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert handler.cancelled and handler.submitted == []
