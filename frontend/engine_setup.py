"""What `LLMEngine` (which `LLM` is built on) and `AsyncLLM` share: setting up a front-end (its
tokenizer, the core's limits, the input/output processors built on them, the core client) and
shutting it down."""
from __future__ import annotations

import logging
import os
import weakref
from typing import TYPE_CHECKING, Any, Callable, Generic, Iterable, Sequence, TypeVar

from tidal.frontend.core_client import AsyncMPClient, InprocClient, SyncMPClient
from tidal.frontend.dp_client import DPAsyncClient, DPSyncClient
from tidal.frontend.input_processor import InputProcessor
from tidal.frontend.metrics_stats import IterationStats, StatLoggerBase
from tidal.frontend.output_collector import RequestOutputCollector
from tidal.frontend.output_processor import OutputProcessor
from tidal.protocol import envs
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo, check_model
from tidal.protocol.config_views import ModelConfig
from tidal.protocol.errors import EngineDeadError
from tidal.protocol.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from tidal.protocol.outputs import RequestOutput
from tidal.protocol.request_rules import check_priority

if TYPE_CHECKING:
    from tidal.frontend.metrics_manager import EngineMetrics

logger = logging.getLogger(__name__)

C = TypeVar("C", bound=InprocClient | SyncMPClient | AsyncMPClient | DPSyncClient | DPAsyncClient)
MPClient = SyncMPClient | AsyncMPClient | DPSyncClient | DPAsyncClient
F = TypeVar("F", bound="FrontEnd[Any]")
# vLLM's StatLoggerFactory: called with (vllm_config, engine_index); the logger it returns gets
# record(scheduler_stats, iteration_stats) once per core message and log() with the summary.
StatLoggerFactory = Callable[[EngineConfig, int], StatLoggerBase]


class FrontEnd(Generic[C]):
    """The parts both front-ends hold, and their life cycle. Subclasses call `_start` once."""

    _closed = True  # until _start succeeded: a failed __init__ leaves shutdown() and __del__ harmless
    config: EngineConfig
    vllm_config: EngineConfig  # the config with the core's resolved limits (vLLM's VllmConfig view)
    engine_core: C  # the core client
    tokenizer: Any
    info: ResolvedEngineInfo
    input_processor: InputProcessor
    output_processor: OutputProcessor

    def _start(self, config: EngineConfig, make_client: Callable[[EngineConfig], C],
               stat_loggers: Sequence[StatLoggerFactory] = ()) -> None:
        """Check the model (a ValueError before any process starts), start the core client (the
        core loads its model while this process loads the tokenizer), wait for the core's
        limits, and build the input/output processors on them; with stats on, the metrics
        (vLLM's `stat_loggers` factories are called with (vllm_config, engine_index 0))."""
        if config.model and os.path.isdir(config.model):
            check_model(config)
        client = make_client(config)
        try:  # whatever fails from here on, the core just started must not outlive it
            self._build(config, client, stat_loggers)
        except BaseException:
            client.shutdown()
            raise
        self._closed = False

    def _build(self, config: EngineConfig, client: C, stat_loggers: Sequence[StatLoggerFactory]) -> None:
        tokenizer = load_tokenizer(config)
        info = client.wait_ready()
        self.config, self.engine_core, self.tokenizer, self.info = config, client, tokenizer, info
        # What the core resolved (context length, KV blocks) shows in the vLLM config views.
        self.vllm_config = config.replace(max_model_len=info.max_model_len, num_kv_blocks=info.num_kv_blocks)
        self.input_processor = InputProcessor(tokenizer, max_model_len=info.max_model_len,
                                              vocab_size=info.vocab_size, max_logprobs=config.max_logprobs,
                                              scheduling_policy=config.scheduling_policy, seed=config.seed)
        self.output_processor = OutputProcessor(tokenizer, log_stats=not config.disable_log_stats,
                                                stream_interval=config.stream_interval)
        self.metrics: EngineMetrics | None = None
        if not config.disable_log_stats:
            from tidal.frontend.metrics_manager import EngineMetrics  # prometheus_client only with stats on

            engines = list(range(config.data_parallel_size))
            self.metrics = EngineMetrics(
                self.model_config.served_model_name or config.model, info.max_model_len,
                stat_loggers=[make(self.vllm_config, 0) for make in stat_loggers], vllm_config=self.vllm_config,
                engine_indexes=engines,
                engine_stat_loggers={i: [make(self.vllm_config, i) for make in stat_loggers] for i in engines[1:]})

    @property
    def logger_manager(self) -> EngineMetrics | None:
        """vLLM's attribute (its StatLoggerManager): what records the stats and runs the stat
        loggers (`record`, `log`, `log_engine_initialized`); None with stats off."""
        return self.metrics

    @property
    def model_config(self) -> ModelConfig:
        return self.vllm_config.model_config

    def _tokenizer_or_raise(self) -> Any:
        if self.tokenizer is None:
            raise ValueError("Unable to get tokenizer because skip_tokenizer_init is True")
        return self.tokenizer

    def _apply_request_options(self, request: EngineCoreRequest, priority: int,
                               lora_request: Any = None, data_parallel_rank: int | None = None) -> None:
        """vLLM's per-request options: ValueError for what tidal (or the policy) cannot honour."""
        if lora_request is not None:
            raise ValueError(f"Got lora_request {lora_request} but LoRA is not enabled! (tidal has no LoRA adapters)")
        size = self.config.data_parallel_size
        if data_parallel_rank is not None and not (
                isinstance(data_parallel_rank, int) and 0 <= data_parallel_rank < size):
            raise ValueError(f"data_parallel_rank {data_parallel_rank} is out of range [0, {size}).")
        request.data_parallel_rank = data_parallel_rank
        if (problem := check_priority(priority, self.config.scheduling_policy)) is not None:
            raise ValueError(problem)  # the core's rule and words (request_rules)
        request.priority = priority

    def _send(self, request: EngineCoreRequest, prompt: str | None,
              queue: RequestOutputCollector | None = None) -> None:
        """Track a processed request and send it (n > 1: its children) to the core. If any
        part fails, nothing of the request stays: neither its state here nor a child that
        already reached the core."""
        sent: list[str] = []
        try:
            for req in self.output_processor.add_request(request, prompt, queue):
                self.engine_core.add_request(req)
                sent.append(req.request_id)
        except BaseException:
            if sent:
                self._abort_silently(sent)  # their final output from the core is then ignored
            self.output_processor.remove_request(request.request_id)
            raise

    def _supervise(self: F, on_lost: Callable[[F, str], None] | None = None,
                   on_dead: Callable[[F, EngineDeadError], None] | None = None) -> None:
        """Attach this front-end to its core's supervisor (frontend/supervisor.py): from now on a
        lost core is replaced and the open requests resume on it. Weakly: the client's threads
        must not keep the front-end alive (its __del__ shuts the core down). With data
        parallelism each core's supervisor gets one such attachment."""
        ref = weakref.ref(self)

        def resumer(rank: int) -> Callable[[list[str] | None], list[EngineCoreOutput]]:
            def resume(failed_step_request_ids: list[str] | None) -> list[EngineCoreOutput]:
                front_end = ref()
                return [] if front_end is None else front_end._resume_requests(failed_step_request_ids, rank)
            return resume

        def weak(fn: Callable[[F, Any], None] | None) -> Callable[[Any], None] | None:
            if fn is None:
                return None

            def call(arg: Any) -> None:
                if (front_end := ref()) is not None:
                    fn(front_end, arg)
            return call

        client = self.engine_core
        assert isinstance(client, MPClient)
        for rank, supervisor in enumerate(client.supervisors):
            supervisor.attach(resumer(rank), on_lost=weak(on_lost), on_dead=weak(on_dead))

    def _resume_requests(self, failed_step_request_ids: list[str] | None, rank: int = 0) -> list[EngineCoreOutput]:
        """The supervisor replaced a lost core (data parallelism: core `rank`): send the new one
        every request the lost one held, resuming where its stream is; returns ERROR outputs for
        the requests given up (triage: see frontend/recovery.py), to be processed like any core
        output."""
        client = self.engine_core
        assert isinstance(client, MPClient)
        resend, give_up = self.output_processor.resume_after_crash(failed_step_request_ids, client.held_by(rank))
        client.resubmit(resend, rank)
        if self.metrics is not None:
            self.metrics.record_core_restart(rank)
        quarantined = sum(r.quarantined for r in resend)
        logger.warning("resumed %d request(s) on the restarted engine core%s%s", len(resend),
                       f" ({quarantined} quarantined: each runs alone until its next token)" if quarantined else "",
                       f"; gave up on {len(give_up)} in flight during repeated failures" if give_up else "")
        return give_up

    def _new_iteration(self) -> IterationStats | None:
        """What one core message's outputs feed when stats are on (see _record_iteration)."""
        return None if self.metrics is None else IterationStats()

    def _record_iteration(self, scheduler_stats: SchedulerStats | None, it: IterationStats | None,
                          engine_idx: int = 0) -> None:
        if self.metrics is not None and it is not None:
            self.metrics.record(scheduler_stats, it, engine_idx=engine_idx)
            self.metrics.maybe_log()

    def _process_outputs(self, outputs: list[EngineCoreOutput], timestamp: float | None = None,
                         it: IterationStats | None = None) -> list[RequestOutput | Exception]:
        """Process core outputs (see OutputProcessorOutput) of the message stamped `timestamp`,
        into `it` (stats on); the requests a stop string finished here are aborted in the core,
        which has not finished them."""
        processed = self.output_processor.process_outputs(outputs, timestamp, it)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def _abort_silently(self, request_ids: Iterable[str]) -> None:
        """End these requests (a parent id: its children) without output, here and in the core,
        which may be gone already: then there is nothing left to abort there."""
        ids = self.output_processor.abort_requests(request_ids)
        try:
            self.engine_core.abort_requests(ids)
        except Exception as e:
            logger.debug("abort of %s not sent: %s", ids, e)

    def begin_shutdown(self) -> None:
        """The application is shutting down: a core lost from now on is not restarted (its
        end is part of the shutdown, e.g. a SIGTERM to the whole process group), while the
        requests in flight go on until shutdown()."""
        self.engine_core.supervisor.shutting_down = True

    def shutdown(self) -> None:
        """Stop the engine core; idempotent. A headless core keeps running: it is told to drop
        this front-end's requests."""
        if self._closed:
            return
        self._closed = True
        # Its supervisor goes DEAD first: AsyncLLM's dead callback ends every open stream.
        self.engine_core.shutdown(abort=list(self.output_processor.request_states))

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def sync_client(config: EngineConfig) -> SyncMPClient | DPSyncClient:
    """LLM's client: one core, or data_parallel_size of them."""
    return DPSyncClient(config) if config.data_parallel_size > 1 else SyncMPClient(config)


def async_client(config: EngineConfig) -> AsyncMPClient | DPAsyncClient:
    """AsyncLLM's client: one core, or data_parallel_size of them."""
    return DPAsyncClient(config) if config.data_parallel_size > 1 else AsyncMPClient(config)


def load_tokenizer(config: EngineConfig) -> Any:
    """The Hugging Face tokenizer of `config.tokenizer_path` (a fast one unless tokenizer_mode
    is "slow"); None with skip_tokenizer_init (token-id prompts, no text out)."""
    if config.skip_tokenizer_init:
        return None
    path = config.tokenizer_path
    if not path:
        raise ValueError("no model or tokenizer given")
    # "org/name" may be a hub id (resolved through the HF cache); an absolute or explicitly
    # relative path is a local directory, and a clear message beats the hub's validation error.
    if path.startswith(("/", "./", "../", "~")) and not os.path.isdir(os.path.expanduser(path)):
        raise ValueError(f"model directory {path!r} does not exist")
    if os.path.isdir(path) and not any(
            os.path.exists(os.path.join(path, f)) for f in ("tokenizer.json", "tokenizer_config.json",
                                                            "tokenizer.model", "vocab.json")):
        raise ValueError(f"no tokenizer files in {path!r}; pass tokenizer=... to name another directory")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no fork warnings from the Rust pool

    loaded: list[Any] = []

    def load_full() -> Any:
        """transformers' tokenizer, loaded at most once (the lean tokenizer's verdict may have
        loaded it already when the lean path is then refused)."""
        if not loaded:
            from transformers import AutoTokenizer  # ~1.5 s of imports, torch among them

            # As vLLM: the tokenizer's revision defaults to the model's.
            revision = config.tokenizer_revision or config.revision
            loaded.append(AutoTokenizer.from_pretrained(path, trust_remote_code=config.trust_remote_code,
                                                        revision=revision, use_fast=config.tokenizer_mode != "slow"))
        return loaded[0]

    if config.tokenizer_mode != "slow" and os.path.isdir(path) and not envs.TIDAL_FULL_TOKENIZER:
        from tidal.frontend.tokenizer import load_lean_tokenizer

        # The same Rust tokenizer without importing transformers (see frontend/tokenizer.py).
        lean = load_lean_tokenizer(path, load_full)
        if lean is not None:
            return lean
    return load_full()
