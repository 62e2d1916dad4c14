"""A request's work ends when its client goes away: waiting for the disconnect, and running a
handler's work until then (cancelling it closes its generate() streams, which aborts the
requests in the core)."""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.requests import Request
from starlette.types import Receive

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def wait_disconnect(receive: Receive) -> None:
    """Return once the ASGI server reports the client's disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or ClientGone once the client disconnects first: then `work` is
    cancelled, which closes its generate() streams and so aborts the requests in the core."""
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
