"""Worker: one per device. Loads its shard of the model, owns its KV cache, runs steps.

With tensor_parallel_size=1 it lives in the engine core's process (UniProcExecutor); otherwise
each rank runs in its own process (worker/worker_proc.py) and rank 0 answers for all.
"""
from __future__ import annotations

import logging
import os

import torch

from tidal.protocol.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, ResolvedEngineInfo
from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput
from tidal.protocol.utils import max_useful_kv_blocks, threads_per_rank
from tidal.worker.hf_config import load_hf_config
from tidal.worker.layers.gemm import warm_up_gemm_buckets
from tidal.worker.startup_timer import StartupTimer

logger = logging.getLogger(__name__)


def resolve_device(config: EngineConfig, rank: int) -> torch.device:
    if config.device == "cpu" or (config.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("device='cuda' was asked for, but torch sees no CUDA device")
    return torch.device("cuda", rank % torch.cuda.device_count())


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
        model_max = int(getattr(hf_config, "max_position_embeddings", 2048))
        if cfg.max_model_len is not None and cfg.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {cfg.max_model_len} is larger than the model's "
                f"max_position_embeddings {model_max}")
        self.max_model_len = cfg.max_model_len or model_max
        torch.manual_seed(cfg.seed)
        self.hf_config = hf_config
        timer.mark("config")
        self.model = load_model(cfg.model, hf_config, self.dtype, cfg.load_format, self.device, cfg.seed)
        timer.mark("model load")
        num_blocks = self._num_kv_blocks()
        self.model_runner = ModelRunner(self.model, block_size=cfg.block_size,
                                        vocab_size=hf_config.vocab_size, device=self.device,
                                        is_driver=self.rank == 0, logprobs_mode=cfg.logprobs_mode)
        self.model_runner.bind_kv_cache(num_blocks, self.kv_cache_dtype)
        timer.mark("KV allocation")
        if self.device.type == "cpu":
            warm_up_gemm_buckets(self.model, cfg.max_num_seqs)
            timer.mark("warm-up")
        timer.log(self.rank)
        return ResolvedEngineInfo(self.max_model_len, num_blocks, cfg.block_size, hf_config.vocab_size)

    def kv_bytes_per_block(self) -> int:
        from tidal.worker.attention import Attention

        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        elt = torch.empty((), dtype=self.kv_cache_dtype).element_size()
        return sum(2 * self.config.block_size * m.num_kv_heads * m.head_dim * elt for m in layers)

    def _num_kv_blocks(self) -> int:
        cfg = self.config
        if cfg.num_kv_blocks is not None:
            return cfg.num_kv_blocks
        per_block = self.kv_bytes_per_block()
        if cfg.kv_cache_memory_bytes is not None:
            budget = cfg.kv_cache_memory_bytes
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        else:
            budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = min(budget // per_block, max_useful_kv_blocks(cfg.max_num_seqs, self.max_model_len, cfg.block_size))
        if blocks < 1:
            raise ValueError(
                f"the KV cache budget of {budget} bytes holds no block of {per_block} bytes: "
                "raise kv_cache_memory_bytes / gpu_memory_utilization")
        if self.world_size > 1:
            # Every rank must agree on the pool; take the smallest.
            from tidal.worker.parallel_state import all_reduce_min

            blocks = all_reduce_min(blocks)
        return int(blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        return self.model_runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.world_size > 1:
            from tidal.worker.parallel_state import destroy_distributed

            destroy_distributed()
