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
            _merge_request_output(current, item, self.aggregate)

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


def _merge_request_output(current: RequestOutput, new: RequestOutput, aggregate: bool) -> None:
    current.finished = new.finished
    current.num_cached_tokens = new.num_cached_tokens
    current.metrics = new.metrics
    if new.prompt_logprobs is not None:
        current.prompt_logprobs = (current.prompt_logprobs + new.prompt_logprobs if aggregate
                                   and current.prompt_logprobs is not None else new.prompt_logprobs)
    outputs = current.outputs
    for nxt in new.outputs:
        for i, cur in enumerate(outputs):
            if cur.index == nxt.index:
                if aggregate:  # copies, never extending lists another output may share
                    cur.text += nxt.text
                    cur.token_ids = cur.token_ids + nxt.token_ids
                    if nxt.logprobs:
                        cur.logprobs = (cur.logprobs or []) + nxt.logprobs
                    cur.cumulative_logprob = nxt.cumulative_logprob
                    cur.finish_reason = nxt.finish_reason
                    cur.stop_reason = nxt.stop_reason
                else:
                    outputs[i] = nxt
                break
        else:
            outputs.append(nxt)
            outputs.sort(key=lambda c: c.index)
