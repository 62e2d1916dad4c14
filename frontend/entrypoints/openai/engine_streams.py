"""A handler's generate() streams: the first output awaited before the response starts, all
of a request's prompts gathered (or merged, streamed), the one output of a FINAL_ONLY stream."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Generator, Sequence
from http import HTTPStatus
from typing import Any, Generic, TypeVar

from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.protocol.outputs import RequestOutput

T = TypeVar("T")


async def primed(gen: AsyncIterator[RequestOutput]) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
    """The first output and the stream: a request the engine refuses raises here (ValueError
    before anything is queued), so it is answered with a 400 status, not inside a 200 stream."""
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        raise APIError("the engine returned no output", HTTPStatus.INTERNAL_SERVER_ERROR) from None
    return first, gen


def gather_all(works: Sequence[Awaitable[T]]) -> Gathered[T]:
    """All results; on the first failure the others are cancelled (their requests aborted)."""
    return Gathered(works)


class Gathered(Generic[T]):
    """gather_all's awaitable. `close()` drops it unstarted with the works it holds (a client
    already gone: disconnect.until_disconnect), as a coroutine's close() would drop one."""

    __slots__ = ("works",)

    def __init__(self, works: Sequence[Awaitable[T]]) -> None:
        self.works = works

    def __await__(self) -> Generator[Any, None, list[T]]:
        return self._run().__await__()

    def close(self) -> None:
        for w in self.works:
            close = getattr(w, "close", None)
            if close is not None:
                close()

    async def _run(self) -> list[T]:
        works = self.works
        if len(works) == 1:
            return [await works[0]]
        tasks = [asyncio.ensure_future(w) for w in works]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise


async def final_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    """The one output of a FINAL_ONLY stream."""
    final = None
    async for out in gen:
        final = out
    if final is None:
        raise APIError("the engine returned no output", HTTPStatus.INTERNAL_SERVER_ERROR)
    return final


async def merged(streams: Sequence[tuple[RequestOutput, AsyncIterator[RequestOutput]]]
                 ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, output) from several primed streams as they come; one stream (the usual
    case) is passed through without tasks. Closing this closes (aborts) every stream."""
    if len(streams) == 1:
        first, gen = streams[0]
        try:
            yield 0, first
            async for out in gen:
                yield 0, out
        finally:
            await gen.aclose()  # type: ignore[attr-defined]  # aborts the request if the client left
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, first: RequestOutput, gen: AsyncIterator[RequestOutput]) -> None:
        try:
            queue.put_nowait((i, first))
            async for out in gen:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, f, g)) for i, (f, g) in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
