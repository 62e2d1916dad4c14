"""LLM: the synchronous, offline front-end (vLLM's `LLM`).

`LLM(model=...).generate(prompts, sampling_params)` validates every prompt, queues them all,
then drives the engine core until each has finished, returning outputs in input order with a
tqdm bar of input/output tokens/s. The core runs in its own process (SyncMPClient: blocking
socket, polled in slices that re-check for a dead core) unless multiprocessing is off
(`multiprocessing=False` or env TIDAL_ENABLE_MULTIPROCESSING=0): then EngineCore runs in this
process behind the same client interface (InprocClient), which is easier to debug.
"""
from __future__ import annotations

import functools
import itertools
import time
from typing import Any, Sequence, overload

from tidal.frontend.beam_search import beam_search
from tidal.frontend.chat_utils import check_chat_options, render_chat, resolve_chat_template
from tidal.frontend.core_client import InprocClient, SyncMPClient
from tidal.frontend.engine_args import EngineArgs
from tidal.frontend.engine_setup import FrontEnd, StatLoggerFactory
from tidal.frontend.metrics_reader import Metric
from tidal.frontend.request_ids import RequestIds
from tidal.protocol import envs
from tidal.protocol.config import EngineConfig
from tidal.protocol.beam_search import BeamSearchOutput, BeamSearchParams
from tidal.protocol.config_views import CacheConfig, ModelConfig
from tidal.protocol.errors import EngineGenerateError
from tidal.protocol.messages import SchedulerStats
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict
_OUTPUT_WAIT_S = 1.0  # one wait for the next step; death is re-checked at least every 100 ms


class LLM(FrontEnd[InprocClient | SyncMPClient]):
    def __init__(self, model: str, *, multiprocessing: bool | None = None, **kwargs: Any) -> None:
        """`kwargs` are vLLM's engine args (EngineArgs fields); a misspelt name is a TypeError
        suggesting the right one. As vLLM's LLM, stats are off unless disable_log_stats=False.
        `multiprocessing` (tidal's): run the core in its own process (default) or in this one."""
        kwargs.setdefault("disable_log_stats", True)
        self._init(EngineArgs(model=model, **kwargs).create_engine_config(), multiprocessing)

    def _init(self, config: EngineConfig, multiprocessing: bool | None,
              stat_loggers: Sequence[StatLoggerFactory] = ()) -> None:
        if multiprocessing is None:
            multiprocessing = envs.TIDAL_ENABLE_MULTIPROCESSING or config.core_address is not None
        elif not multiprocessing and config.core_address is not None:
            raise ValueError("core_address needs multiprocessing: the core is another process")
        # Request ids as vLLM's LLM shows them ('0', '1', ...); in the core each carries this
        # LLM's tag too, so front-ends sharing a headless core never collide.
        self._ids = itertools.count()
        self._request_ids = RequestIds(tag_chars=12)
        # Outputs of llm_engine.add_request's requests that arrived while generate() waited,
        # or beside a failure that step() raised: the next step() returns them first.
        self._backlog: list[RequestOutput | EngineGenerateError] = []
        self._start(config, SyncMPClient if multiprocessing else InprocClient, stat_loggers)
        if isinstance(self.engine_core, SyncMPClient):
            # A lost core is replaced inside the wait that notices it (no callbacks needed).
            self._supervise()

    # ------------------------------------------------------------------ public
    def get_tokenizer(self) -> Any:
        """The tokenizer; ValueError with skip_tokenizer_init (as vLLM)."""
        return self._tokenizer_or_raise()

    @property
    def llm_engine(self) -> "LLMEngine":
        """vLLM's `llm.llm_engine` (a fresh view each time: no reference cycle keeps an LLM,
        and so its core, alive)."""
        return LLMEngine(self)

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.call_utility("get_stats")

    def get_metrics(self) -> list[Metric]:
        """vLLM's: a snapshot of every metric (Counter/Gauge/Histogram/Vector records named
        `vllm:...`), counted since this LLM started; needs disable_log_stats=False."""
        if self.metrics is None:
            raise ValueError("metrics are recorded only with disable_log_stats=False")
        return self.metrics.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False if blocks are still in use."""
        return bool(self.engine_core.call_utility("reset_prefix_cache"))

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request: Any = None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order. Every prompt is validated
        (ValueError) before any is queued. `priority`: one per prompt (lower runs first), with
        scheduling_policy="priority"; `lora_request` must be None (tidal has no LoRA)."""
        if self._closed:
            raise RuntimeError("this LLM was shut down")
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"got {len(priority)} priorities for {len(prompt_list)} prompts; pass one per prompt")
        requests = []
        for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True)):
            req, text = self.input_processor.process(self._request_ids.fixed(str(next(self._ids))), prompt,
                                                     params.clone(output_kind=RequestOutputKind.FINAL_ONLY))
            self._apply_request_options(req, 0 if priority is None else priority[i], lora_request)
            requests.append((req, text))
        if not requests:
            return []
        order = {req.request_id: i for i, (req, _) in enumerate(requests)}
        try:
            for req, text in requests:
                self._send(req, text)
            return self._run(order, use_tqdm)
        except BaseException:
            # Ctrl-C, a dead core or a failed request: leave no request behind in either process.
            self._abort_silently(list(self.output_processor.request_states))
            raise

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             lora_request: Any = None, chat_template: str | None = None, chat_template_content_format: str = "auto",
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None, chat_template_kwargs: dict[str, Any] | None = None,
             mm_processor_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's LLM.chat: one conversation (a list of messages) or several, each rendered by
        the chat template (the tokenizer's, or `chat_template`) and generated as generate()
        does. The template writes the special tokens, so none are added when tokenizing."""
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: tidal serves text-only models")
        check_chat_options(add_generation_prompt, continue_final_message, chat_template_content_format)
        tok = self._tokenizer_or_raise()
        template = resolve_chat_template(tok, chat_template)
        single = bool(messages) and isinstance(messages[0], dict)
        conversations = [messages] if single else list(messages)
        template_kwargs = {**({"tools": tools} if tools else {}), **(chat_template_kwargs or {})}
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = render_chat(tok, conversation, template, content_format=chat_template_content_format,
                               add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, template_kwargs=template_kwargs)
            prompts.append({"prompt": text, "prompt_token_ids": list(tok.encode(text, add_special_tokens=False))})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(self, prompts: Sequence[PromptType], params: BeamSearchParams, lora_request: Any = None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search, run on this engine one token per live beam per step (see
        frontend/beam_search.py)."""
        return beam_search(functools.partial(self.generate, use_tqdm=False), self._tokenizer_or_raise(),
                           prompts, params, self.input_processor.eos_token_id, lora_request=lora_request,
                           use_tqdm=use_tqdm, concurrency_limit=concurrency_limit,
                           max_model_len=self.info.max_model_len)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate() uses when given no sampling params: the model's
        generation_config.json defaults (generation_config="auto"), else SamplingParams()."""
        diff = self.model_config.get_diff_sampling_param()
        return SamplingParams.from_optional(**diff) if diff else SamplingParams()

    # ----------------------------------------------------------------- helpers
    def _params_for(self, prompts: list[Any], sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts; "
                                 "pass one, or one per prompt")
            for p in sampling_params:
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params must hold SamplingParams, got {type(p).__name__}")
            return list(sampling_params)
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                         f"got {type(sampling_params).__name__}")

    def _run(self, order: dict[str, int], use_tqdm: bool) -> list[RequestOutput]:
        """Wait for generate()'s requests (`order`: id -> input index); what comes for the
        step API's requests meanwhile waits in the backlog for its step()."""
        results: list[RequestOutput | None] = [None] * len(order)
        bar = _ProgressBar(len(order)) if use_tqdm else None
        left = len(order)
        try:
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
                        if bar is not None:
                            bar.update(out)
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

    def _poll(self) -> list[RequestOutput | Exception]:
        """One wait (bounded) for the core's next message; its outputs, processed."""
        outs = self.engine_core.get_output(_OUTPUT_WAIT_S)
        if outs is None or not outs.outputs:
            return []
        it = self._new_iteration()
        processed = self._process_outputs(outs.outputs, outs.timestamp, it)
        self._record_iteration(outs.scheduler_stats, it)
        return processed

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


def _visible_id(internal_id: str) -> str:
    """The id vLLM's LLM shows ('0', '1', ...; or the step API's own) of an internal one."""
    return RequestIds.external(internal_id)


@overload
def _visible(out: RequestOutput) -> RequestOutput: ...
@overload
def _visible(out: Exception) -> EngineGenerateError: ...
def _visible(out: RequestOutput | Exception) -> RequestOutput | EngineGenerateError:
    """An output with the request's visible id (in place); a request's failure as an
    EngineGenerateError naming it."""
    if isinstance(out, RequestOutput):
        out.request_id = _visible_id(out.request_id)
        return out
    err = out if isinstance(out, EngineGenerateError) else EngineGenerateError(str(out))
    if isinstance(rid := getattr(err, "request_id", None), str):
        err.request_id = _visible_id(rid)  # type: ignore[attr-defined]
    return err


class _ProgressBar:
    """vLLM's bar: finished prompts, with estimated input and output tokens/s."""

    def __init__(self, total: int) -> None:
        from tqdm.auto import tqdm

        self._bar = tqdm(total=total, desc="Processed prompts", dynamic_ncols=True,
                         postfix="est. speed input: 0.00 toks/s, output: 0.00 toks/s")
        self._start = time.perf_counter()
        self._in = self._out = 0

    def update(self, out: RequestOutput) -> None:
        self._in += len(out.prompt_token_ids)
        self._out += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self._start, 1e-9)
        self._bar.postfix = (f"est. speed input: {self._in / elapsed:.2f} toks/s, "
                             f"output: {self._out / elapsed:.2f} toks/s")
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


class LLMEngine:
    """`llm.llm_engine`: vLLM's LLMEngine over an LLM -- its attributes (vllm_config,
    model_config, tokenizer, get_tokenizer, log_stats) and its step API (add_request, step,
    has_unfinished_requests, abort_request; `LLMEngine.from_engine_args` builds one on an LLM
    of its own); anything else (call_utility, get_stats, process, address, ...) is the
    engine-core client's. Step-API requests and generate() share the engine: generate() waits
    for its own requests only, and what arrives for the others meanwhile waits for step()."""

    def __init__(self, llm: LLM) -> None:
        self._llm = llm

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
        llm = LLM.__new__(LLM)
        llm._init(vllm_config.replace(disable_log_stats=disable_log_stats), enable_multiprocessing,
                  stat_loggers or ())
        return cls(llm)

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None, lora_request: Any = None,
                    tokenization_kwargs: dict[str, Any] | None = None, trace_headers: Any = None,
                    priority: int = 0, prompt_text: str | None = None) -> None:
        """Validate and queue one request (ValueError for a bad one, or an id still running);
        its outputs come from step(), in its params' output_kind (CUMULATIVE by default)."""
        llm = self._llm
        if llm._closed:
            raise RuntimeError("this LLM was shut down")
        internal = llm._request_ids.fixed(request_id)  # ValueError for an empty or non-str id
        if tokenization_kwargs:
            raise ValueError("tokenization_kwargs: tidal tokenizes prompts one way (pass token ids to choose)")
        op = llm.output_processor
        if internal in op.request_states or internal in op.parent_requests:
            raise ValueError(f"request id {request_id!r} is already running")
        params = params if params is not None else llm.get_default_sampling_params()
        req, text = llm.input_processor.process(internal, prompt, params, arrival_time=arrival_time)
        llm._apply_request_options(req, priority, lora_request)
        llm._send(req, text)

    def step(self) -> list[RequestOutput]:
        """The outputs of the engine's next step (waits for it, up to about a second; [] when
        nothing is running). A request that failed is raised as an EngineGenerateError naming
        it; the step's other outputs then come from the next call."""
        llm = self._llm
        if not llm._backlog and llm.output_processor.has_unfinished_requests():
            llm._backlog = [_visible(out) for out in llm._poll()]
        outs, llm._backlog = llm._backlog, []
        for i, out in enumerate(outs):
            if isinstance(out, Exception):
                llm._backlog = outs[:i] + outs[i + 1:]
                raise out
        return outs  # type: ignore[return-value]

    def has_unfinished_requests(self) -> bool:
        return self._llm.output_processor.has_unfinished_requests() or bool(self._llm._backlog)

    def get_num_unfinished_requests(self) -> int:
        """Requests (not n > 1 children) still running."""
        return len({st.external_req_id for st in self._llm.output_processor.request_states.values()})

    def abort_request(self, request_ids: str | Sequence[str]) -> None:
        """End these requests (unknown or finished ids are ignored) with no further output."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self._llm._abort_silently(self._llm._request_ids.fixed(rid) for rid in ids)

    @property
    def vllm_config(self) -> EngineConfig:
        return self._llm.vllm_config

    @property
    def model_config(self) -> ModelConfig:
        return self._llm.vllm_config.model_config

    @property
    def cache_config(self) -> CacheConfig:
        return self._llm.vllm_config.cache_config

    @property
    def log_stats(self) -> bool:
        return not self._llm.config.disable_log_stats

    @property
    def tokenizer(self) -> Any:
        return self._llm.tokenizer

    def get_tokenizer(self) -> Any:
        return self._llm.get_tokenizer()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm.engine_core, name)
