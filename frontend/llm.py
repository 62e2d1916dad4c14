"""LLM: the synchronous, offline front-end (vLLM's `LLM`), built on an LLMEngine.

`LLM(model=...).generate(prompts, sampling_params)` validates every prompt, queues them all,
then drives the engine (`llm.llm_engine`, frontend/llm_engine.py: the core client, the
processors, the step API) until each has finished, returning outputs in input order with a
tqdm bar of input/output tokens/s.
"""
from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, ClassVar, Sequence

from tidal.frontend.beam_search import beam_search
from tidal.frontend.chat_utils import check_chat_options, render_chat, resolve_chat_template
from tidal.frontend.core_client import InprocClient, SyncMPClient
from tidal.frontend.engine_args import EngineArgs
from tidal.frontend.input_processor import InputProcessor
from tidal.frontend.llm_engine import LLMEngine, PromptType
from tidal.frontend.metrics_reader import Metric
from tidal.frontend.output_processor import OutputProcessor
from tidal.protocol.beam_search import BeamSearchOutput, BeamSearchParams
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.config_views import ModelConfig
from tidal.protocol.errors import VLLMValidationError
from tidal.protocol.messages import SchedulerStats
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tidal.frontend.metrics_manager import EngineMetrics

__all__ = ["LLM", "LLMEngine"]


class LLM:
    # vLLM's switch for warnings on its legacy generate()/encode() arguments; tidal has no
    # legacy API to warn about, so the flag only records what the caller asked for.
    DEPRECATE_LEGACY: ClassVar[bool] = False

    @classmethod
    @contextmanager
    def deprecate_legacy_api(cls) -> Iterator[None]:
        cls.DEPRECATE_LEGACY = True
        try:
            yield
        finally:
            cls.DEPRECATE_LEGACY = False

    def __init__(self, model: str, *, multiprocessing: bool | None = None, **kwargs: Any) -> None:
        """`kwargs` are vLLM's engine args (EngineArgs fields); a misspelt name is a TypeError
        suggesting the right one. As vLLM's LLM, stats are off unless disable_log_stats=False.
        `multiprocessing` (tidal's): run the core in its own process (default) or in this one."""
        kwargs.setdefault("disable_log_stats", True)
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        self.llm_engine = LLMEngine(config, multiprocess_mode=multiprocessing)
        self._ids = itertools.count()  # generate()'s request ids, '0', '1', ... (vLLM's counter)

    # ------------------------------------------------------------------ public
    # The engine's parts, as the LLM shows them (vLLM's LLM has model_config, input_processor).
    @property
    def config(self) -> EngineConfig:
        return self.llm_engine.config

    @property
    def vllm_config(self) -> EngineConfig:
        return self.llm_engine.vllm_config

    @property
    def model_config(self) -> ModelConfig:
        return self.llm_engine.model_config

    @property
    def engine_core(self) -> InprocClient | SyncMPClient:
        return self.llm_engine.engine_core

    @property
    def info(self) -> ResolvedEngineInfo:
        return self.llm_engine.info

    @property
    def tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    @property
    def input_processor(self) -> InputProcessor:
        return self.llm_engine.input_processor

    @property
    def output_processor(self) -> OutputProcessor:
        return self.llm_engine.output_processor

    @property
    def metrics(self) -> EngineMetrics | None:
        return self.llm_engine.metrics

    def get_tokenizer(self) -> Any:
        """The tokenizer; ValueError with skip_tokenizer_init (as vLLM)."""
        return self.llm_engine.get_tokenizer()

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
                 priority: int | Sequence[int] | None = None) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order. Every prompt is validated
        (ValueError) before any is queued. `priority`: one for every prompt, or one per prompt
        (lower runs first), with scheduling_policy="priority"; `lora_request` must be None
        (tidal has no LoRA)."""
        engine = self.llm_engine
        engine._check_open()
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        if isinstance(priority, int):
            priority = [priority] * len(prompt_list)
        if priority is not None and len(priority) != len(prompt_list):
            raise VLLMValidationError(f"got {len(priority)} priorities for {len(prompt_list)} prompts; "
                                      "pass one, or one per prompt", parameter="priority")
        final_only = RequestOutputKind.FINAL_ONLY
        requests = [engine._process(str(next(self._ids)), prompt, params.clone(output_kind=final_only),
                                    0 if priority is None else priority[i], lora_request)
                    for i, (prompt, params) in enumerate(zip(prompt_list, params_list, strict=True))]
        if not requests:
            return []
        bar = _ProgressBar(len(requests)) if use_tqdm else None
        try:
            return engine._generate(requests, None if bar is None else bar.update)
        finally:
            if bar is not None:
                bar.close()

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
        tok = self.get_tokenizer()
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
        return beam_search(functools.partial(self.generate, use_tqdm=False), self.get_tokenizer(),
                           prompts, params, self.input_processor.eos_token_id, lora_request=lora_request,
                           use_tqdm=use_tqdm, concurrency_limit=concurrency_limit,
                           max_model_len=self.info.max_model_len)

    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's: what generate() uses when given no sampling params: the model's
        generation_config.json defaults (generation_config="auto"), else SamplingParams()."""
        return self.llm_engine._default_sampling_params()

    # ----------------------------------------------------------------- helpers
    def _params_for(self, prompts: list[Any], sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * len(prompts)
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * len(prompts)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise VLLMValidationError(f"got {len(sampling_params)} sampling params for {len(prompts)} "
                                          "prompts; pass one, or one per prompt", parameter="sampling_params")
            for p in sampling_params:
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params must hold SamplingParams, got {type(p).__name__}")
            return list(sampling_params)
        raise ValueError(f"sampling_params must be a SamplingParams or a list of them, "
                         f"got {type(sampling_params).__name__}")

    def begin_shutdown(self) -> None:
        self.llm_engine.begin_shutdown()

    def shutdown(self) -> None:
        """Stop the engine core; idempotent (see LLMEngine.shutdown)."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()


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
