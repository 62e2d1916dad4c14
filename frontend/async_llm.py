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
import logging
import threading
import warnings
from typing import Any, AsyncGenerator, Callable, Iterable, Literal, TypeVar

from tidal.frontend.core_client import AsyncMPClient
from tidal.frontend.dp_client import DPAsyncClient
from tidal.frontend.engine_args import AsyncEngineArgs
from tidal.frontend.engine_setup import FrontEnd, StatLoggerFactory, async_client
from tidal.frontend.output_collector import RequestOutputCollector
from tidal.frontend.request_ids import RequestIds, check_request_id
from tidal.frontend.supervisor import CoreState
from tidal.protocol.config import EngineConfig
from tidal.protocol.config_views import ModelConfig
from tidal.protocol.errors import EngineDeadError, EngineGenerateError, EngineRestartingError
from tidal.protocol.messages import EngineCoreRequest, SchedulerStats
from tidal.protocol.outputs import CompletionOutput, RequestOutput
from tidal.protocol.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# The handler processes a step's outputs in slices of _OUTPUT_SLICE and yields to the event loop
# once _YIELD_EVERY outputs were processed since its last yield (awaiting the socket yields too),
# so it never holds the loop for more than ~0.5 ms. A consumer that lags meanwhile gets its
# DELTA chunks merged (losslessly) in its collector; 512 measured no better once the core
# stopped bunching its messages.
_OUTPUT_SLICE = 128
_YIELD_EVERY = _OUTPUT_SLICE
_DRAIN_POLL_S = 0.01  # pause_generation's waits ("wait", "keep") check this often
_T = TypeVar("_T")
PauseMode = Literal["abort", "wait", "keep"]  # vLLM's (vllm.v1.engine.PauseMode)
_PAUSE_MODES = ("abort", "wait", "keep")

class AsyncLLM(FrontEnd[AsyncMPClient | DPAsyncClient]):
    def __init__(self, model: str, *, stat_loggers: list[StatLoggerFactory] | None = None,
                 **kwargs: Any) -> None:
        """`kwargs` are vLLM's engine args (AsyncEngineArgs fields); a misspelt name is a
        TypeError suggesting the right one. Stats are off unless disable_log_stats=False (as
        tidal's LLM; `from_engine_args` follows the args, whose default is on, as vLLM)."""
        kwargs.setdefault("disable_log_stats", True)
        args = AsyncEngineArgs(model=model, **kwargs)
        self._setup(args.create_engine_config(), log_requests=args.enable_log_requests,
                    stat_loggers=stat_loggers)

    @classmethod
    def from_engine_args(cls, engine_args: AsyncEngineArgs, start_engine_loop: bool = True,
                         usage_context: Any = None,
                         stat_loggers: list[StatLoggerFactory] | None = None) -> "AsyncLLM":
        """vLLM's constructor. `start_engine_loop`: tidal's output loop always starts with the
        first request in the running event loop; `usage_context` changes nothing here."""
        self = cls.__new__(cls)
        self._setup(engine_args.create_engine_config(usage_context),
                    log_requests=getattr(engine_args, "enable_log_requests", False), stat_loggers=stat_loggers)
        return self

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, start_engine_loop: bool = True,
                         usage_context: Any = None, stat_loggers: list[StatLoggerFactory] | None = None,
                         enable_log_requests: bool = False, aggregate_engine_logging: bool = False,
                         disable_log_stats: bool = False, client_addresses: dict[str, str] | None = None,
                         client_count: int = 1, client_index: int = 0) -> "AsyncLLM":
        """vLLM's constructor from `EngineArgs.create_engine_config()` (tidal's VllmConfig is
        its EngineConfig). As in vLLM, `disable_log_stats` here decides the stats."""
        if client_addresses or client_count != 1 or client_index != 0:
            raise ValueError("client_addresses/client_count/client_index: API-server scale-out is not "
                             "supported by tidal (connect to a `tidal core` with core_address instead)")
        self = cls.__new__(cls)
        self._setup(vllm_config.replace(disable_log_stats=disable_log_stats),
                    log_requests=enable_log_requests, stat_loggers=stat_loggers)
        return self

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncLLM":
        self = cls.__new__(cls)
        self._setup(config)
        return self

    def _setup(self, config: EngineConfig, *, log_requests: bool = False,
               stat_loggers: list[StatLoggerFactory] | None = None) -> None:
        self._handler: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._running: dict[str, str] = {}  # user request id -> internal id
        self._request_ids = RequestIds()
        self._resumed: asyncio.Event | None = None  # set while paused; set() on resume
        self._restart: asyncio.Task[None] | None = None  # replacing a lost core (_recover)
        self.log_requests = log_requests
        self._start(config, async_client, stat_loggers or ())
        # Both from the watcher thread or the handler; each runs in the loop's thread.
        self._supervise(on_lost=lambda engine, reason: engine._in_loop(engine._on_lost, reason),
                        on_dead=lambda engine, exc: engine._in_loop(engine._fail_streams, exc))

    # ------------------------------------------------------------------ status
    @property
    def errored(self) -> bool:
        """Dead by a failure (a clean shutdown() is not one)."""
        supervisor = self.engine_core.supervisor
        return supervisor.error is not None and not supervisor.dead_by_shutdown

    @property
    def is_running(self) -> bool:
        return not self._closed and not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        return self.engine_core.supervisor.error or EngineDeadError("the engine was shut down")

    def _check_alive(self) -> None:
        if self._closed or self.engine_core.supervisor.error is not None:
            raise EngineDeadError(str(self.dead_error)) from None

    async def get_tokenizer(self) -> Any:
        """The tokenizer; ValueError with skip_tokenizer_init (as vLLM)."""
        return self._tokenizer_or_raise()

    async def get_model_config(self) -> ModelConfig:
        return self.model_config

    async def get_vllm_config(self) -> EngineConfig:
        return self.vllm_config

    async def check_health(self) -> None:
        """vLLM's health check: EngineDeadError once the engine is dead (shut down, or its core
        lost with no restart left or restarts off: max_core_restarts=0). While a lost core is
        being replaced, EngineRestartingError (an EngineDeadError: a health endpoint answers
        503 meanwhile) -- and the restart is set going if nothing else had (a core lost while
        no stream was open). Passes again once the new core answered. Reads `errored` as
        vLLM's does (its test patches that property)."""
        if self.errored:
            raise EngineDeadError(str(self.dead_error))
        self._check_alive()
        supervisor = self.engine_core.supervisor
        if supervisor.restarting:
            if supervisor.state is CoreState.LOST:
                self._ensure_handler()  # starts the restart (nothing if one is under way)
            raise EngineRestartingError(f"the engine core is being restarted after it was lost "
                                        f"({supervisor.reason}); its requests resume once it is back")

    # ---------------------------------------------------------------- generate
    async def generate(self, prompt: str | dict, sampling_params: SamplingParams | None,
                       request_id: str, *, prompt_text: str | None = None, lora_request: Any = None,
                       tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                       priority: int = 0, data_parallel_rank: int | None = None,
                       arrival_time: float | None = None) -> AsyncGenerator[RequestOutput, None]:
        """Stream `RequestOutput`s for one request (kinds and errors: see DESIGN.md).

        vLLM's signature: (prompt, sampling_params, request_id) positionally or by keyword;
        `priority` needs scheduling_policy="priority"; `lora_request` must be None and
        `data_parallel_rank` None or 0; `prompt_text`, `tokenization_kwargs` and
        `trace_headers` are accepted and unused. While paused, waits for resume_generation()."""
        self._check_alive()
        await self._wait_unpaused()
        self._check_alive()
        check_request_id(request_id)
        if request_id in self._running:
            raise ValueError(f"request id {request_id!r} is already running")
        params = SamplingParams() if sampling_params is None else sampling_params
        self._ensure_handler()
        internal = self._request_ids.unique(request_id)
        self._running[request_id] = internal  # before any await: the id is taken from here on
        queue: RequestOutputCollector | None = None
        finished = False
        try:
            queue = await self._add_request(request_id, internal, prompt, params, arrival_time,
                                            (priority, lora_request, data_parallel_rank))
            if self.log_requests:
                logger.info("Added request %s.", request_id)
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

    async def _add_request(self, request_id: str, internal: str, prompt: str | dict, params: SamplingParams,
                           arrival_time: float | None,
                           options: tuple[int, Any, int | None]) -> RequestOutputCollector:
        # ValueError for bad input comes from here, before anything is queued.
        request, prompt_text = await self.input_processor.process_async(internal, prompt, params, arrival_time)
        self._apply_request_options(request, *options)
        # A long prompt is tokenized off the loop: a pause or an abort may have come meanwhile.
        # Not in flight yet, the request waits out a pause; an abort ends it without sending.
        await self._wait_unpaused()
        self._check_alive()
        queue = RequestOutputCollector(params.output_kind)
        if self._running.get(request_id) != internal:
            queue.put(_aborted_before_sending(request, prompt_text))
            return queue
        try:
            self._send(request, prompt_text, queue)
        except BaseException:
            self._abort_silently([internal])
            raise
        return queue

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """End these requests' streams normally (finish_reason "abort", partial output) and
        abort them in the core. Unknown or finished ids are ignored. `internal`: the ids are
        tidal's internal ones (as vLLM's flag), not the callers'."""
        self._check_alive()
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if internal:
            wanted = set(ids)
            ids = [rid for rid, iid in self._running.items() if iid in wanted]
        internals = [self._running.pop(rid) for rid in ids if rid in self._running]
        if internals:
            it = self._new_iteration()
            result = self.output_processor.finish_request_aborted(internals, it)
            self._record_iteration(None, it)
            self.engine_core.abort_requests(result.reqs_to_abort)

    # ------------------------------------------------------------ pause/resume
    async def pause_generation(self, *, mode: PauseMode = "abort", wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:
        """vLLM's pause (for weight updates): until resume_generation(), new generate() calls
        wait (nothing of them reaches the core). `mode`, for the requests in flight:

        - "abort" (the default): aborted; their streams end with finish_reason "abort" and
          their partial output before this returns.
        - "wait": run to their end before this returns (no timeout: as long as they take).
        - "keep": frozen; their streams stay open and go on after resume_generation(), with
          the same tokens as without the pause (they leave the core, which then holds no
          request and computes nothing, and are sent back to resume where they were, as after
          a core restart). Returns once the core let go of each of them.

        `wait_for_inflight_requests` (deprecated, as in vLLM): True means mode="wait".
        `clear_cache`: then the prefix cache is reset (with "keep", the frozen requests
        recompute their prompt and tokens so far on resume). Pausing while paused applies the
        new mode to what is in flight. EngineDeadError if the engine dies meanwhile."""
        if mode not in _PAUSE_MODES:
            raise ValueError(f"Invalid pause mode: {mode!r} (expected one of {', '.join(_PAUSE_MODES)})")
        if wait_for_inflight_requests:
            warnings.warn("The `wait_for_inflight_requests` parameter in `AsyncLLM.pause_generation()` is "
                          "deprecated. Please use `mode` argument instead.", DeprecationWarning, stacklevel=2)
            mode = "wait"
        self._check_alive()
        if self._resumed is None:
            self._resumed = asyncio.Event()
        processor = self.output_processor
        if mode == "abort":
            await self.abort(list(self._running))  # the frozen ones too
        elif mode == "keep":
            if ids := processor.park_requests():
                self.engine_core.abort_requests(ids)  # dropped while the core restarts: see recovery
        # Polled: the output handler, not a waiter, learns when a request ends, and a short
        # poll costs nothing next to the requests it waits for.
        if mode == "wait":
            await self._poll_until(lambda: not processor.has_unparked_requests())
        else:
            await self._poll_until(lambda: not processor.has_parking())
        if clear_cache:
            await self.reset_prefix_cache()

    async def _poll_until(self, done: Callable[[], bool]) -> None:
        while not done():
            self._check_alive()
            await asyncio.sleep(_DRAIN_POLL_S)

    async def resume_generation(self) -> None:
        """Lift the pause: waiting generate() calls go on, and requests frozen by mode="keep"
        are sent back to the core, each resuming where its stream is. Nothing when not paused."""
        processor = self.output_processor
        if processor.num_parked():
            await self._poll_until(lambda: not processor.has_parking())  # a pause("keep") still settling
            for request in processor.unpark_requests():
                try:
                    self.engine_core.add_request(request)  # while a core restarts: resent with the rest
                except EngineDeadError:
                    raise
                except Exception as e:  # this one cannot go back (say, too big a message): it alone ends
                    logger.error("request %s could not be resumed after the pause: %s", request.request_id, e)
                    processor.fail_request(request.request_id, f"resuming the request after the pause failed: {e}")
        resumed, self._resumed = self._resumed, None
        if resumed is not None:
            resumed.set()

    async def is_paused(self) -> bool:
        """Between pause_generation() and resume_generation()."""
        return self._resumed is not None

    async def _wait_unpaused(self) -> None:
        while (resumed := self._resumed) is not None:
            await resumed.wait()

    # ---------------------------------------------------------- output handler
    def _ensure_handler(self) -> None:
        loop = asyncio.get_running_loop()
        supervisor = self.engine_core.supervisor
        if supervisor.state in (CoreState.LOST, CoreState.RECONNECTING):
            # The restart task starts the handler when it is done. Lost while no loop was there
            # to hear of it: replace it now.
            self._loop, self._loop_thread = loop, threading.get_ident()
            self._on_lost(supervisor.reason or "")  # nothing if a restart is under way
            return
        if self._handler is not None and not self._handler.done() and self._loop is loop:
            return
        # First use, or a new event loop (the old one is gone, and its task with it).
        self._loop, self._loop_thread = loop, threading.get_ident()
        self._handler = loop.create_task(self._output_handler(), name="tidal-output-handler")

    async def _output_handler(self) -> None:
        client, since_yield = self.engine_core, 0
        try:
            while True:
                outs = await client.get_output_async()
                if not client.supervisor.live:
                    return  # the restart task takes over (and starts a new handler)
                it = self._new_iteration()  # one per core message, across its slices
                outputs = outs.outputs
                n = len(outputs)
                for start in range(0, n, _OUTPUT_SLICE):
                    if since_yield >= _YIELD_EVERY:
                        # A message that was already waiting is returned without suspending, so
                        # the consumers (and the rest of the application) get their turn here.
                        since_yield = 0
                        await asyncio.sleep(0)
                    chunk = outputs if n <= _OUTPUT_SLICE else outputs[start:start + _OUTPUT_SLICE]
                    since_yield += len(chunk)
                    self._process_outputs(chunk, outs.timestamp, it)  # into the requests' collectors
                self._record_iteration(outs.scheduler_stats, it, outs.engine_index)
        except asyncio.CancelledError:
            raise
        except EngineDeadError:
            pass  # the client marked itself dead; its dead callback told every stream
        except Exception as e:
            logger.exception("AsyncLLM output handler failed")
            client.supervisor.core_gone(f"the front-end output handler failed: {type(e).__name__}: {e}",
                                        restartable=False)  # a new core would not fix this front-end

    # ----------------------------------------------------------------- restart
    def _on_lost(self, reason: str) -> None:
        """In the loop's thread, when the supervisor lost its core: stop the handler and start
        the task that has the supervisor replace the core and resume every open stream."""
        if self.engine_core.supervisor.state is not CoreState.LOST or (
                self._restart is not None and not self._restart.done()):
            return
        handler = self._handler
        if handler is not None and not handler.done() and handler is not asyncio.current_task():
            handler.cancel()
        self._restart = asyncio.get_running_loop().create_task(self._recover(handler), name="tidal-core-restart")

    async def _recover(self, handler: asyncio.Task[None] | None) -> None:
        supervisor = self.engine_core.supervisor
        if handler is not None and handler is not asyncio.current_task():
            # The handler returns or is cancelled at its next await; never wait on it forever.
            await asyncio.wait([handler], timeout=5.0)
        try:
            if give_up := await supervisor.recover_async():
                it = self._new_iteration()
                self._process_outputs(give_up, None, it)
                self._record_iteration(None, it)
        except EngineDeadError:
            return  # the supervisor's dead callback failed every stream
        except Exception as e:  # unhandled, this task would end alone and every stream wait forever
            logger.exception("AsyncLLM: ending the given-up requests after a core restart failed")
            supervisor.fail(f"resuming the requests on the restarted engine core failed: {type(e).__name__}: {e}")
            return
        self._handler = None
        if not self._closed:
            self._ensure_handler()

    def _in_loop(self, fn: Callable[[_T], None], arg: _T) -> None:
        """Run `fn(arg)` on the event loop's thread: now if this is it, else as soon as the loop
        gets to it. Nothing when no live loop ever opened a stream (there is none to fail)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        if threading.get_ident() == self._loop_thread:
            fn(arg)
            return
        try:
            loop.call_soon_threadsafe(fn, arg)
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
        if (restart := self._restart) is not None and not restart.done():
            # Bounded by the restart's own handshake timeout (engine_start_timeout_s).
            await asyncio.shield(restart)
            self._check_alive()
        return await self.engine_core.call_utility_async(method, *args)

    async def get_stats(self) -> SchedulerStats:
        return await self.call_utility_async("get_stats")

    async def reset_prefix_cache(self) -> bool:
        return await self.call_utility_async("reset_prefix_cache")

    async def do_log_stats(self, *args: Any) -> None:
        """vLLM's: every stat logger logs now (the one-line summary, the user's loggers);
        nothing with stats off."""
        if self.metrics is not None:
            self.metrics.log()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    # ---------------------------------------------------------------- shutdown
    # shutdown() (FrontEnd's): the supervisor's DEAD ends every open stream (its dead callback).
    async def __aenter__(self) -> "AsyncLLM":
        return self

    async def __aexit__(self, *exc_info: Any) -> None:
        self.shutdown()


def _aborted_before_sending(request: EngineCoreRequest, prompt: str | None) -> RequestOutput:
    """The one output of a request aborted before it reached the core: nothing generated."""
    completions = [CompletionOutput(i, "", [], None, None, "abort") for i in range(request.sampling_params.n)]
    return RequestOutput(request.request_id, prompt, request.prompt_token_ids, None, completions, True)
