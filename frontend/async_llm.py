"""AsyncLLM: the asyncio front-end (vLLM V1's async_llm.py).

Per request: InputProcessor (tokenize, validate, seed) -> OutputProcessor state with a
RequestOutputCollector -> ADD to the engine core. One output-handler task per engine (started
lazily in the running loop) reads one message per core step, runs the OutputProcessor in slices
(yielding to the loop in between) which puts into the collectors, and aborts in the core the
requests a stop string finished. `generate()` drains its collector.

Request ids: the user's id maps to a unique internal id (`<id>#<engine tag><n>`) used with the
core and the OutputProcessor, so that an id is reusable the moment its request ended and two
front-ends sharing a headless core never collide; outputs carry the user's id again. So
"already running" is checked here only, on the user's ids (`_running`).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import uuid
import weakref
from typing import Any, AsyncGenerator, Callable, Iterable

from tidal.frontend.core_client import AsyncMPClient
from tidal.frontend.engine_setup import FrontEnd
from tidal.frontend.output_processor import RequestOutputCollector
from tidal.protocol.config import EngineConfig
from tidal.protocol.errors import EngineDeadError, EngineGenerateError
from tidal.protocol.messages import SchedulerStats
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The handler processes a step's outputs in slices of _OUTPUT_SLICE and yields to the event loop
# once _YIELD_EVERY outputs were processed since its last yield (awaiting the socket yields too),
# so it never holds the loop for more than ~0.5 ms. A consumer that lags meanwhile gets its
# DELTA chunks merged (losslessly) in its collector; 512 measured no better once the core
# stopped bunching its messages.
_OUTPUT_SLICE = 128
_YIELD_EVERY = _OUTPUT_SLICE


class AsyncLLM(FrontEnd[AsyncMPClient]):
    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        """`engine_args` are EngineConfig fields (vLLM's names); unknown names raise TypeError."""
        self._setup(EngineConfig.from_kwargs(model, **engine_args))

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        self = cls.__new__(cls)
        self._setup(config)
        return self

    def _setup(self, config: EngineConfig) -> None:
        self._handler: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._running: dict[str, str] = {}  # user request id -> internal id
        self._tag = uuid.uuid4().hex[:8]
        self._ids = itertools.count()
        self._start(config, AsyncMPClient)
        # Weakly: the client's watcher thread must not keep this engine alive (and its __del__,
        # which shuts the core down, from ever running).
        ref = weakref.ref(self)

        def on_dead(exc: EngineDeadError) -> None:  # from the watcher thread or the handler
            engine = ref()
            if engine is not None:
                engine._in_loop(engine._fail_streams, exc)

        self.engine_core.add_dead_callback(on_dead)

    # ------------------------------------------------------------------ status
    @property
    def errored(self) -> bool:
        return self.engine_core.dead is not None

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return self.engine_core.dead or EngineDeadError("the engine was shut down")

    def _check_alive(self) -> None:
        if self._closed or self.engine_core.dead is not None:
            raise EngineDeadError(str(self.dead_error)) from None

    async def get_tokenizer(self) -> Any:
        return self.tokenizer

    async def check_health(self) -> None:
        self._check_alive()

    # ---------------------------------------------------------------- generate
    async def generate(self, prompt: str | dict, sampling_params: SamplingParams | None,
                       request_id: str, *,
                       arrival_time: float | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream `RequestOutput`s for one request (kinds and errors: see DESIGN.md).

        Arguments in vLLM's order (prompt, sampling_params, request_id), so positional calls
        written for vLLM's AsyncLLM keep working; keywords work too."""
        self._check_alive()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        if request_id in self._running:
            raise ValueError(f"request id {request_id!r} is already running")
        params = SamplingParams() if sampling_params is None else sampling_params
        self._ensure_handler()
        internal = f"{request_id}#{self._tag}{next(self._ids):x}"
        self._running[request_id] = internal  # before any await: the id is taken from here on
        queue: RequestOutputCollector | None = None
        finished = False
        try:
            queue = await self._add_request(internal, prompt, params, arrival_time)
            while not finished:
                out = queue.get_nowait() or await queue.get()
                finished = out.finished
                out.request_id = request_id
                yield out
        except EngineDeadError:
            finished = True
            raise EngineDeadError(str(self.dead_error)) from None
        except EngineGenerateError:
            finished = True
            self._abort_silently([internal])  # the failed child's siblings (n > 1)
            raise
        except (asyncio.CancelledError, GeneratorExit):
            if queue is not None and not finished:
                self._abort_silently([internal])  # no await here: this also runs in aclose()
            raise
        finally:
            if self._running.get(request_id) == internal:
                del self._running[request_id]

    async def _add_request(self, internal: str, prompt: str | dict, params: SamplingParams,
                           arrival_time: float | None) -> RequestOutputCollector:
        # ValueError for bad input comes from here, before anything is queued.
        request, prompt_text = await self.input_processor.process_async(internal, prompt, params, arrival_time)
        self._check_alive()
        queue = RequestOutputCollector(params.output_kind)
        try:
            self._send(request, prompt_text, queue)
        except BaseException:
            self._abort_silently([internal])
            raise
        return queue

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """End these requests' streams normally (finish_reason "abort", partial output) and
        abort them in the core. Unknown or finished ids are ignored."""
        self._check_alive()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        internals = [self._running.pop(rid) for rid in ids if rid in self._running]
        if internals:
            result = self.output_processor.finish_request_aborted(internals)
            self.engine_core.abort_requests(result.reqs_to_abort)

    # ---------------------------------------------------------- output handler
    def _ensure_handler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._handler is not None and not self._handler.done() and self._loop is loop:
            return
        # First use, or a new event loop (the old one is gone, and its task with it).
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._handler = loop.create_task(self._output_handler(), name="tidal-output-handler")

    async def _output_handler(self) -> None:
        client, since_yield = self.engine_core, 0
        try:
            while True:
                outputs = (await client.get_output_async()).outputs
                n = len(outputs)
                for start in range(0, n, _OUTPUT_SLICE):
                    if since_yield >= _YIELD_EVERY:
                        # A message that was already waiting is returned without suspending, so
                        # the consumers (and the rest of the application) get their turn here.
                        since_yield = 0
                        await asyncio.sleep(0)
                    chunk = outputs if n <= _OUTPUT_SLICE else outputs[start:start + _OUTPUT_SLICE]
                    since_yield += len(chunk)
                    self._process_outputs(chunk)  # into the requests' collectors
        except asyncio.CancelledError:
            raise
        except EngineDeadError:
            pass  # the client marked itself dead; its dead callback told every stream
        except Exception as e:
            logger.exception("AsyncLLM output handler failed")
            client.mark_dead(f"the front-end output handler failed: {type(e).__name__}: {e}")

    def _in_loop(self, fn: Callable[[EngineDeadError], None], exc: EngineDeadError) -> None:
        """Run `fn(exc)` on the event loop's thread: now if this is it, else as soon as the loop
        gets to it. Nothing when no live loop ever opened a stream (there is none to fail)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            fn(exc)
            return
        try:
            loop.call_soon_threadsafe(fn, exc)
        except RuntimeError:  # the loop closed in between
            pass

    def _fail_streams(self, exc: EngineDeadError) -> None:
        self.output_processor.propagate_error(exc)
        self.engine_core.fail_pending_utilities(exc)
        handler = self._handler
        if handler is not None and not handler.done() and handler is not asyncio.current_task():
            handler.cancel()

    # ----------------------------------------------------------------- utility
    async def call_utility_async(self, method: str, *args: Any) -> Any:
        self._check_alive()
        self._ensure_handler()  # it reads the reply
        return await self.engine_core.call_utility_async(method, *args)

    async def get_stats(self) -> SchedulerStats:
        return await self.call_utility_async("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache")

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---------------------------------------------------------------- shutdown
    def _on_shutdown(self) -> None:
        """Open streams end with EngineDeadError."""
        self._in_loop(self._fail_streams, EngineDeadError("the engine was shut down"))

    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.shutdown()
