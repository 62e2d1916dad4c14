"""Worker: one per device. Loads its shard of the model, owns its KV cache, runs steps.

With tensor_parallel_size=1 it lives in the engine core's process (UniProcExecutor); otherwise
each rank runs in its own process (worker/worker_proc.py) and rank 0 answers for all.
"""
from __future__ import annotations

import logging
import os

import torch

from tidal.protocol.config import (DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ResolvedEngineInfo, config_positions,
                                   resolve_max_model_len)
from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput
from tidal.protocol.sizing import kv_blocks_for_budget, kv_cache_budget_from_memory, max_step_tokens
from tidal.utils.openmp import threads_per_rank
from tidal.worker.draft_model import DraftProposer
from tidal.worker.hf_config import load_hf_config
from tidal.worker.layers.gemm import warm_up_gemm_buckets
from tidal.worker.startup_timer import StartupTimer

logger = logging.getLogger(__name__)


def resolve_device(config: EngineConfig, rank: int) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for, but torch sees no CUDA device")
    # Data-parallel cores on one host take consecutive device groups: core d's rank r is on
    # device d * tensor_parallel_size + r.
    index = config.dp_local_index * config.tensor_parallel_size + rank
    return torch.device("cuda", index % torch.cuda.device_count())


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, world_size: int = 1,
                 distributed_init_method: str | None = None,
                 distributed_listen_fd: int | None = None) -> None:
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.distributed_init_method = distributed_init_method
        self.distributed_listen_fd = distributed_listen_fd  # rank 0: the rendezvous socket
        self.device = resolve_device(config, rank)
        self.drafter: DraftProposer | None = None  # speculative_config's draft model, if any
        if self.device.type == "cuda" and world_size > torch.cuda.device_count():
            # Two ranks on one GPU would only fail later, inside NCCL, with a vaguer message.
            raise ValueError(f"tensor_parallel_size={world_size} needs {world_size} CUDA devices; "
                             f"this process sees {torch.cuda.device_count()}")

    def initialize(self) -> ResolvedEngineInfo:
        from tidal.worker.loader import load_model, resolve_dtype
        from tidal.worker.model_runner import ModelRunner
        from tidal.worker.models.registry import get_model_class

        timer = StartupTimer("python + imports")
        cfg = self.config
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        elif "OMP_NUM_THREADS" not in os.environ:  # an explicit setting wins
            torch.set_num_threads(threads_per_rank(self.world_size))
        if self.world_size > 1:
            from tidal.worker.parallel_state import init_distributed

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            assert self.distributed_init_method is not None
            init_distributed(self.rank, self.world_size, self.distributed_init_method, backend,
                             listen_fd=self.distributed_listen_fd)
        hf_config = load_hf_config(cfg.model)
        get_model_class(hf_config)  # unknown architecture -> ValueError listing the supported
        self.dtype = resolve_dtype(cfg.dtype, hf_config)
        # "auto": the model's dtype; a half cache under float32 weights works too (the kernels
        # and the torch path convert on write and read).
        self.kv_cache_dtype = self.dtype if cfg.kv_cache_dtype == "auto" else resolve_dtype(cfg.kv_cache_dtype, hf_config)
        self.max_model_len = resolve_max_model_len(cfg.max_model_len,
                                                   config_positions(hf_config, cfg.disable_sliding_window))
        if cfg.disable_sliding_window:
            hf_config.sliding_window = None  # every layer attends the full context
        torch.manual_seed(cfg.seed)
        self.hf_config = hf_config
        timer.mark("config")
        self.model = load_model(cfg.model, hf_config, self.dtype, cfg.load_format, self.device, cfg.seed,
                                quantization=cfg.quantization)
        timer.mark("model load")
        self.drafter = self._load_draft_model()
        num_blocks = self._num_kv_blocks()
        self.model_runner = ModelRunner(self.model, block_size=cfg.block_size,
                                        vocab_size=hf_config.vocab_size, device=self.device,
                                        is_driver=self.rank == 0, logprobs_mode=cfg.logprobs_mode,
                                        max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=self._max_step_tokens(),
                                        max_model_len=self.max_model_len)
        self.model_runner.drafter = self.drafter
        self.model_runner.bind_kv_cache(num_blocks, self.kv_cache_dtype)
        timer.mark("KV allocation")
        if self.device.type == "cuda" and not cfg.enforce_eager:
            self.model_runner.capture_cuda_graphs(cfg.cuda_graph_sizes)
            timer.mark("CUDA graphs")
        if self.device.type == "cpu":
            warm_up_gemm_buckets(self.model, cfg.max_num_seqs)
            if self.drafter is not None:
                warm_up_gemm_buckets(self.drafter.model, cfg.max_num_seqs)
            timer.mark("warm-up")
            if not cfg.enforce_eager:
                spec = self.config.speculative_config
                self.model_runner.capture_cpu_graphs(0 if spec is None else spec.num_speculative_tokens)
                timer.mark("CPU graphs")
        timer.log(self.rank)
        return ResolvedEngineInfo(self.max_model_len, num_blocks, cfg.block_size, hf_config.vocab_size,
                                  self.device.type)

    def _load_draft_model(self) -> DraftProposer | None:
        """speculative_config's draft model, in the target's dtype on the target's device (and
        under its tensor parallelism); None without one."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        from tidal.worker.draft_model import check_draft_compatible
        from tidal.worker.loader import load_model

        assert spec.model is not None
        draft_config = load_hf_config(spec.model)
        check_draft_compatible(self.config.model, spec.model, self.hf_config, draft_config)
        model = load_model(spec.model, draft_config, self.dtype, self.config.load_format, self.device,
                           self.config.seed)
        return DraftProposer(model)

    def kv_bytes_per_block(self) -> int:
        from tidal.worker.attention import Attention

        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        if self.drafter is not None:  # the draft's KV shares the target's blocks
            layers += self.drafter.attention_layers
        elt = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return sum(2 * self.config.block_size * m.num_kv_heads * m.head_dim * elt for m in layers)

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            blocks = cfg.num_kv_blocks
        else:
            if cfg.kv_cache_memory_bytes is not None:
                budget, how = cfg.kv_cache_memory_bytes, "kv_cache_memory_bytes"
            elif self.device.type == "cuda":
                budget = self._cuda_kv_budget()
                how = f"gpu_memory_utilization={cfg.gpu_memory_utilization}"
            else:
                budget, how = DEFAULT_CPU_KV_CACHE_BYTES, "the CPU default; set kv_cache_memory_bytes"
            blocks = kv_blocks_for_budget(budget, self.kv_bytes_per_block(), max_num_seqs=cfg.max_num_seqs,
                                          max_model_len=self.max_model_len, block_size=cfg.block_size, how=how)
        if self.world_size > 1:
            # Every rank must agree on the pool; take the smallest.
            from tidal.worker.parallel_state import all_reduce_min

            blocks = all_reduce_min(blocks)
        tokens = blocks * cfg.block_size
        logger.info("KV cache: %d blocks, %d tokens, %s; max concurrency at max_model_len=%d: %.2fx",
                    blocks, tokens, self.kv_cache_dtype, self.max_model_len, tokens / self.max_model_len)
        return int(blocks)

    def _cuda_kv_budget(self) -> int:
        """gpu_memory_utilization's share of the device, less what is in use now (weights,
        context, other processes) and the activation peak of the largest step, measured."""
        peak = self._profile_peak_activation()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = kv_cache_budget_from_memory(total, total - free, peak, self.config.gpu_memory_utilization)
        logger.info("memory: %.2f GiB of %.2f GiB in use, activation peak %.2f GiB, KV budget %.2f GiB",
                    (total - free) / 2**30, total / 2**30, peak / 2**30, budget / 2**30)
        return budget

    def _max_step_tokens(self) -> int:
        cfg = self.config
        return max_step_tokens(cfg.max_num_batched_tokens, self.max_model_len, cfg.enable_chunked_prefill)

    @torch.inference_mode()
    def _profile_peak_activation(self) -> int:
        """Bytes the largest step allocates beyond what is held now: one forward over the most
        tokens a step can schedule (no KV cache bound yet, so attention runs as one causal
        sequence), the LM head over max_num_seqs rows (and one more per speculative proposal),
        and a float32 softmax as the sampler's."""
        cfg, dev = self.config, self.device
        tokens = self._max_step_tokens()
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        ids = torch.zeros(tokens, dtype=torch.long, device=dev)
        positions = torch.arange(tokens, device=dev) % self.max_model_len
        hidden = self.model(ids, positions)
        spec = cfg.speculative_config  # each proposal is one more sampled row
        rows = cfg.max_num_seqs * (1 + (spec.num_speculative_tokens if spec is not None else 0))
        logits = self.model.compute_logits(hidden[: min(tokens, rows)]).float()
        torch.softmax(logits, dim=-1)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - base
        del ids, positions, hidden, logits
        return int(peak)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.world_size > 1:
            from tidal.worker.parallel_state import destroy_distributed

            destroy_distributed()
