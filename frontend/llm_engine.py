"""LLMEngine: the synchronous engine (vLLM's `LLMEngine`), which `LLM` is built on.

It holds the front-end (tokenizer, processors, core client: see engine_setup.FrontEnd), the
request ids and the step API (add_request, step, has_unfinished_requests, abort_request). The
core runs in its own process (SyncMPClient: blocking socket, polled in slices that re-check
for a dead core) unless multiprocessing is off (`enable_multiprocessing=False` or env
TIDAL_ENABLE_MULTIPROCESSING=0): then EngineCore runs in this process behind the same client
interface (InprocClient), which is easier to debug.

Step-API requests and `LLM.generate()` share the engine: generate() waits for its own requests
only (`_generate`), and what arrives for the others meanwhile waits for step() in the backlog.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence, overload

from tidal.frontend.core_client import InprocClient, SyncMPClient
from tidal.frontend.dp_client import DPSyncClient
from tidal.frontend.engine_args import EngineArgs
from tidal.frontend.engine_setup import FrontEnd, StatLoggerFactory, sync_client
from tidal.frontend.request_ids import RequestIds
from tidal.protocol import envs
from tidal.protocol.config import EngineConfig
from tidal.protocol.config_views import CacheConfig
from tidal.protocol.errors import EngineGenerateError
from tidal.protocol.messages import EngineCoreRequest
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import SamplingParams

PromptType = str | dict
_OUTPUT_WAIT_S = 1.0  # one wait for the next step; death is re-checked at least every 100 ms


class LLMEngine(FrontEnd[InprocClient | SyncMPClient | DPSyncClient]):
    """vLLM's LLMEngine: its attributes (vllm_config, model_config, cache_config, tokenizer,
    get_tokenizer, log_stats, input_processor, output_processor, engine_core) and its step API
    (add_request, step, has_unfinished_requests, get_num_unfinished_requests, abort_request);
    anything else (call_utility, get_stats, process, address, ...) is the engine-core client's."""

    def __init__(self, vllm_config: EngineConfig, stat_loggers: Sequence[StatLoggerFactory] | None = None,
                 multiprocess_mode: bool | None = None) -> None:
        """Start the engine on `vllm_config` (EngineArgs.create_engine_config()); the core runs
        in its own process unless multiprocess_mode=False (default: TIDAL_ENABLE_MULTIPROCESSING,
        and always with a core_address)."""
        config = vllm_config
        if multiprocess_mode is None:
            multiprocess_mode = envs.TIDAL_ENABLE_MULTIPROCESSING or config.core_address is not None
        elif not multiprocess_mode and config.core_address is not None:
            raise ValueError("core_address needs multiprocessing: the core is another process")
        # Request ids as vLLM shows them ('0', '1', ... for LLM.generate); in the core each
        # carries this engine's tag too, so front-ends sharing a headless core never collide.
        self._request_ids = RequestIds(tag_chars=12)
        # Outputs of add_request's requests that arrived while generate() waited, or beside a
        # failure that step() raised: the next step() returns them first.
        self._backlog: list[RequestOutput | EngineGenerateError] = []
        if not multiprocess_mode and config.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 needs multiprocessing: each engine core is a process")
        self._start(config, sync_client if multiprocess_mode else InprocClient, stat_loggers or ())
        if not isinstance(self.engine_core, InprocClient):
            # A lost core is replaced inside the wait that notices it (no callbacks needed).
            self._supervise()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None,
                         stat_loggers: Sequence[StatLoggerFactory] | None = None,
                         enable_multiprocessing: bool | None = None) -> "LLMEngine":
        """vLLM's constructor; the engine core runs in its own process unless
        enable_multiprocessing=False (or TIDAL_ENABLE_MULTIPROCESSING=0)."""
        return cls.from_vllm_config(engine_args.create_engine_config(usage_context), usage_context,
                                    stat_loggers, disable_log_stats=engine_args.disable_log_stats,
                                    enable_multiprocessing=enable_multiprocessing)

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, usage_context: Any = None,
                         stat_loggers: Sequence[StatLoggerFactory] | None = None, disable_log_stats: bool = False,
                         enable_multiprocessing: bool | None = None) -> "LLMEngine":
        """vLLM's constructor from `EngineArgs.create_engine_config()` (tidal's VllmConfig)."""
        return cls(vllm_config.replace(disable_log_stats=disable_log_stats), stat_loggers,
                   multiprocess_mode=enable_multiprocessing)

    # ---------------------------------------------------------------- step API
    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: Any = None,
                    tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                    priority: int = 0, prompt_text: str | None = None) -> None:
        """Validate and queue one request (ValueError for a bad one, or an id still running);
        its outputs come from step(), in its params' output_kind (CUMULATIVE by default)."""
        self._check_open()
        internal = self._request_ids.fixed(request_id)  # ValueError for an empty or non-str id
        if tokenization_kwargs:
            raise ValueError("tokenization_kwargs: tidal tokenizes prompts one way (pass token ids to choose)")
        op = self.output_processor
        if internal in op.request_states or internal in op.parent_requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params if params is not None else self._default_sampling_params()
        self._send(*self._process(request_id, prompt, params, priority, lora_request, arrival_time))

    def step(self) -> list[RequestOutput]:
        """The outputs of the engine's next step (waits for it, up to about a second; [] when
        nothing is running). A request that failed is raised as an EngineGenerateError naming
        it; the step's other outputs then come from the next call."""
        if not self._backlog and self.output_processor.has_unfinished_requests():
            self._backlog = [_visible(out) for out in self._poll()]
        outs, self._backlog = self._backlog, []
        for i, out in enumerate(outs):
            if isinstance(out, Exception):
                self._backlog = outs[:i] + outs[i + 1:]
                raise out
        return outs  # type: ignore[return-value]

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or bool(self._backlog)

    def get_num_unfinished_requests(self) -> int:
        """Requests (not n > 1 children) still running."""
        return len({st.external_req_id for st in self.output_processor.request_states.values()})

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """End these requests (unknown or finished ids are ignored) with no further output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._abort_silently(self._request_ids.fixed(rid) for rid in ids)

    def do_log_stats(self) -> None:
        """vLLM's: every stat logger logs now (the one-line summary, the user's loggers);
        nothing with stats off."""
        if self.metrics is not None:
            self.metrics.log()

    @property
    def cache_config(self) -> CacheConfig:
        return self.vllm_config.cache_config

    @property
    def log_stats(self) -> bool:
        return not self.config.disable_log_stats

    def get_tokenizer(self) -> Any:
        """The tokenizer; ValueError with skip_tokenizer_init (as vLLM)."""
        return self._tokenizer_or_raise()

    def __getattr__(self, name: str) -> Any:
        # Only what is not found otherwise; never before the client exists (no recursion).
        client = self.__dict__.get("engine_core")
        if client is None or name.startswith("_"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(client, name)

    # ------------------------------------------------------- for LLM.generate
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was shut down")

    def _default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json defaults (generation_config="auto"), else
        SamplingParams()."""
        diff = self.model_config.get_diff_sampling_param()
        return SamplingParams.from_optional(**diff) if diff else SamplingParams()

    def _process(self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
                 lora_request: Any = None, arrival_time: float | None = None
                 ) -> tuple[EngineCoreRequest, str | None]:
        """One request validated (ValueError) and built, under this engine's id for
        `request_id`; not yet sent."""
        req, text = self.input_processor.process(self._request_ids.fixed(request_id), prompt, params,
                                                 arrival_time=arrival_time)
        self._apply_request_options(req, priority, lora_request)
        return req, text

    def _generate(self, requests: list[tuple[EngineCoreRequest, str | None]],
                  on_finished: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Send processed requests and wait until each has finished: their final outputs in
        the given order (`on_finished` sees each as it comes). What comes for the step API's
        requests meanwhile waits in the backlog for its step(); a failed request is raised as
        an EngineGenerateError."""
        order = {req.request_id: i for i, (req, _) in enumerate(requests)}
        results: list[RequestOutput | None] = [None] * len(order)
        try:
            for req, text in requests:
                self._send(req, text)
            left = len(order)
            while left:
                for out in self._poll():
                    index = order.get(getattr(out, "request_id", None))  # every output's error has one
                    if index is None:
                        self._backlog.append(_visible(out))
                    elif isinstance(out, Exception):
                        raise _visible(out)
                    elif out.finished:
                        results[index] = _visible(out)
                        left -= 1
                        if on_finished is not None:
                            on_finished(out)
        except BaseException:
            # Ctrl-C, a dead core or a failed request: leave no request behind in either process.
            self._abort_silently(list(self.output_processor.request_states))
            raise
        return [r for r in results if r is not None]

    def _poll(self) -> list[RequestOutput | Exception]:
        """One wait (bounded) for the core's next message; its outputs, processed."""
        outs = self.engine_core.get_output(_OUTPUT_WAIT_S)
        if outs is None or not outs.outputs:
            return []
        it = self._new_iteration()
        processed = self._process_outputs(outs.outputs, outs.timestamp, it)
        self._record_iteration(outs.scheduler_stats, it, outs.engine_index)
        return processed


@overload
def _visible(out: RequestOutput) -> RequestOutput: ...
@overload
def _visible(out: Exception) -> EngineGenerateError: ...
def _visible(out: RequestOutput | Exception) -> RequestOutput | EngineGenerateError:
    """An output with the request's visible id (in place: '0', '1', ...; or the step API's
    own); a request's failure as an EngineGenerateError naming it."""
    if isinstance(out, RequestOutput):
        out.request_id = RequestIds.external(out.request_id)
        return out
    err = out if isinstance(out, EngineGenerateError) else EngineGenerateError(str(out))
    if isinstance(rid := getattr(err, "request_id", None), str):
        err.request_id = RequestIds.external(rid)  # type: ignore[attr-defined]
    return err
