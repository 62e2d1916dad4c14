"""A request's output queue for AsyncLLM (vLLM V1's RequestOutputCollector): the output
processor puts into it, the request's `generate()` drains it."""
from __future__ import annotations

import asyncio

from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind

_DELTA = RequestOutputKind.DELTA


class RequestOutputCollector:
    """One request's queue for AsyncLLM. Holds at most one item: when the consumer lags, DELTA
    outputs merge into the pending one (nothing is lost), CUMULATIVE/FINAL_ONLY outputs replace
    it (per completion index, so n > 1 children never overwrite each other); an exception wins."""

    __slots__ = ("aggregate", "output", "_waiter")

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == _DELTA
        self.output: RequestOutput | BaseException | None = None
        # The consumer's wake-up: a bare Future made in the running loop by get() (an
        # asyncio.Event's semantics, with less work per wake-up on this hot path).
        self._waiter: asyncio.Future[None] | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        """Non-blocking; call it from the event loop's thread."""
        current = self.output
        if current is None or isinstance(item, BaseException):
            self.output = item
            waiter = self._waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
        elif isinstance(current, RequestOutput):
            current.add(item, self.aggregate)

    async def get(self) -> RequestOutput:
        """The pending output (raising a pending exception), waiting for one if need be."""
        while self.output is None:
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None
        return self.get_nowait()  # type: ignore[return-value]

    def get_nowait(self) -> RequestOutput | None:
        output, self.output = self.output, None
        if isinstance(output, BaseException):
            raise output
        return output
