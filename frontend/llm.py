"""LLM: the synchronous, offline front-end (vLLM's `LLM`).

`LLM(model=...).generate(prompts, sampling_params)` validates every prompt, queues them all,
then drives the engine core until each has finished, returning outputs in input order with a
tqdm bar of input/output tokens/s. The core runs in its own process (SyncMPClient: blocking
socket, polled in slices that re-check for a dead core) unless multiprocessing is off
(`multiprocessing=False` or env TIDAL_ENABLE_MULTIPROCESSING=0): then EngineCore runs in this
process behind the same client interface (InprocClient), which is easier to debug.
"""
from __future__ import annotations

import itertools
import time
from typing import Any, Sequence

from tidal.frontend.core_client import InprocClient, SyncMPClient
from tidal.frontend.engine_setup import FrontEnd
from tidal.protocol import envs
from tidal.protocol.config import EngineConfig
from tidal.protocol.errors import EngineGenerateError
from tidal.protocol.messages import SchedulerStats
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams

PromptType = str | dict
_OUTPUT_WAIT_S = 1.0  # one wait for the next step; death is re-checked at least every 100 ms


class LLM(FrontEnd[InprocClient | SyncMPClient]):
    def __init__(self, model: str | None = None, *, multiprocessing: bool | None = None,
                 **engine_args: Any) -> None:
        """`engine_args` are EngineConfig fields (vLLM's names); unknown names raise TypeError."""
        config = EngineConfig.from_kwargs(model, **engine_args)
        if multiprocessing is None:
            multiprocessing = envs.TIDAL_ENABLE_MULTIPROCESSING or config.core_address is not None
        elif not multiprocessing and config.core_address is not None:
            raise ValueError("core_address needs multiprocessing: the core is another process")
        self._ids = itertools.count()  # request ids: unique, so never running twice
        self._start(config, SyncMPClient if multiprocessing else InprocClient)

    # ------------------------------------------------------------------ public
    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def llm_engine(self) -> InprocClient | SyncMPClient:
        """The engine-core client: `call_utility(method, *args)`, `get_stats()`."""
        return self.engine_core

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.call_utility("get_stats")

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's name); False if blocks are still in use."""
        return bool(self.engine_core.call_utility("reset_prefix_cache"))

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One finished RequestOutput per prompt, in input order. Every prompt is validated
        (ValueError) before any is queued."""
        if self._closed:
            raise RuntimeError("this LLM was shut down")
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_for(prompt_list, sampling_params)
        requests = [
            self.input_processor.process(str(next(self._ids)), prompt,
                                         params.clone(output_kind=RequestOutputKind.FINAL_ONLY))
            for prompt, params in zip(prompt_list, params_list, strict=True)
        ]
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

    # ----------------------------------------------------------------- helpers
    @staticmethod
    def _params_for(prompts: list[Any], sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * len(prompts)
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
        results: list[RequestOutput | None] = [None] * len(order)
        bar = _ProgressBar(len(order)) if use_tqdm else None
        op, client = self.output_processor, self.engine_core
        try:
            while op.has_unfinished_requests():
                outs = client.get_output(_OUTPUT_WAIT_S)
                if outs is None or not outs.outputs:
                    continue
                for out in self._process_outputs(outs.outputs):
                    if isinstance(out, Exception):
                        raise out if isinstance(out, EngineGenerateError) else EngineGenerateError(str(out))
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(out)
        finally:
            if bar is not None:
                bar.close()
        return [r for r in results if r is not None]

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
