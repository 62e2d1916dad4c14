"""A request's work ends when its client goes away, wherever that work is.

`CancelOnDisconnect` (the server's outermost ASGI layer, installed by GracefulServer) is vLLM's
`with_cancellation`/`listen_for_disconnect` for every route at once: once a request's body has
been read it listens on the ASGI receive channel, and when the client disconnects before its
response was sent the request's task is cancelled at once -- while it waits for the chat
template's render pool, for a tokenization, for generate()'s first or last output, or while it
streams. Cancelling closes its generate() streams, which aborts its requests in the core; one not
sent yet is never sent. Before this, a request whose client was gone was still rendered,
tokenized and sent to the core (which prefilled it and decoded until the abort came): after 200
chat requests whose clients gave up at 0.5 s the next request waited 2-11 s behind their work
(issue 31; scripts/bench_abandoned.py).

`until_disconnect` is where a handler hands its request to the engine: a client already gone
then (even one whose disconnect the listener has not been woken for yet) costs nothing there.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.requests import ClientDisconnect, Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

T = TypeVar("T")
logger = logging.getLogger("tidal.frontend.entrypoints.openai.api_server")

SCOPE_KEY = "tidal.client_watch"  # the request's ClientWatch in its ASGI scope
_DISCONNECT: Message = {"type": "http.disconnect"}


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class ClientWatch:
    """One HTTP request's client: the receive channel its app reads (`receive`), the listener
    that cancels the request's task (`task`) when the client leaves before the response has
    been sent, and `gone()`, whether it has left."""

    __slots__ = ("_receive", "_task", "_listener", "_left", "_body_read", "responded", "cancelled")

    def __init__(self, receive: Receive, task: asyncio.Task[Any] | None) -> None:
        self._receive, self._task = receive, task
        self._listener: asyncio.Task[None] | None = None
        self._left: asyncio.Event | None = None  # set once the client is gone (made on demand)
        self._body_read = False
        self.responded = False  # the response's last byte was sent
        self.cancelled = False  # the task was cancelled because the client left

    @property
    def disconnected(self) -> bool:
        return self._left is not None and self._left.is_set()

    async def receive(self) -> Message:
        """The app's receive: the server's until the body has been read; after it, the only
        message left is the disconnect (sent as often as asked for, as servers do)."""
        if not self._body_read:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self._mark_left()  # the app sees it itself (Starlette raises ClientDisconnect)
            elif not message.get("more_body", False):
                self._body_read = True
                self._listen()
            return message
        left = self._left_event()
        if not left.is_set():
            await left.wait()
        return _DISCONNECT

    async def send_through(self, send: Send, message: Message) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.responded = True  # from here a disconnect is the response's end: no cancel
        await send(message)

    def gone(self) -> bool:
        """Whether the client has left. Once the body has been read, a disconnect the server
        already knows of counts even before the listener has been woken for it: the server's
        receive is asked without waiting (it answers a known disconnect at once, else it
        would wait, and the question is dropped)."""
        if self.disconnected:
            return True
        if not self._body_read or self.responded:
            return False
        probe = self._receive()
        try:
            probe.send(None)
        except StopIteration as answer:  # answered without waiting
            if answer.value is not None and answer.value.get("type") == "http.disconnect":
                self._mark_left()
                return True
            return False
        except BaseException:  # a server whose receive fails here: ask the listener, not it
            return False
        probe.close()  # it would have waited: nothing to report yet
        return False

    def close(self) -> None:
        if self._listener is not None and not self._listener.done():
            self._listener.cancel()
        self._listener = None

    def _left_event(self) -> asyncio.Event:
        if self._left is None:
            self._left = asyncio.Event()
        return self._left

    def _listen(self) -> None:
        if self._listener is None and self._task is not None:
            self._listener = asyncio.ensure_future(self._listen_for_disconnect())

    async def _listen_for_disconnect(self) -> None:
        try:
            while (await self._receive())["type"] != "http.disconnect":
                pass
        except Exception as e:  # the server's channel broke: nothing to listen to
            logger.debug("listening for the client's disconnect failed: %s", e)
            return
        self._mark_left()
        if not self.responded and self._task is not None and not self._task.done():
            self.cancelled = True
            self._task.cancel()

    def _mark_left(self) -> None:
        self._left_event().set()


class CancelOnDisconnect:
    """ASGI middleware: an HTTP request's task is cancelled when its client disconnects
    before its response has been sent (ClientWatch); the cancel and a ClientDisconnect of a
    client that left end the request quietly (nobody is there to answer). Outermost, so it
    covers every layer's work; websockets and lifespan pass through."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        task = asyncio.current_task()
        watch = ClientWatch(receive, task)
        scope[SCOPE_KEY] = watch

        async def send_through(message: Message) -> None:
            await watch.send_through(send, message)

        try:
            await self.app(scope, watch.receive, send_through)
        except asyncio.CancelledError:
            if not watch.cancelled:
                raise  # the server's (its shutdown)
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+
            if uncancel is not None and uncancel() > 0:
                raise  # the server cancelled it too
        except ClientDisconnect:
            if not watch.disconnected:
                raise
        finally:
            watch.close()


def client_watch(request: Request) -> ClientWatch | None:
    return request.scope.get(SCOPE_KEY)


def client_gone(request: Request) -> bool:
    """Whether the request's client is known to have left (False without CancelOnDisconnect)."""
    watch = client_watch(request)
    return watch is not None and watch.gone()


async def wait_disconnect(receive: Receive) -> None:
    """Return once the ASGI server reports the client's disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone once the client disconnects first: then `work` is
    cancelled, which closes its generate() streams and so aborts the requests in the core.
    Handlers pass the work that hands the request to the engine: a client already gone by
    then raises ClientGone before `work` starts, so the engine never gets the request. Under
    CancelOnDisconnect the request's own task is cancelled at the disconnect, so `work` runs
    in it (no task of its own, no second listener)."""
    watch = client_watch(request)
    if watch is not None:
        if watch.gone():
            _discard(work)
            raise ClientGone()
        return await work
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the server is shutting down: end the work with it
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except BaseException:
        pass
    raise ClientGone()


def _discard(work: Awaitable[Any]) -> None:
    """Drop work that never started (no 'never awaited' warning; a future is cancelled)."""
    close = getattr(work, "close", None)
    if close is not None:
        close()
    elif isinstance(work, asyncio.Future):
        work.cancel()
