"""Executors: how the engine core reaches its model workers.

`UniProcExecutor` keeps the single worker in the core's own process (tensor_parallel_size=1);
`MultiprocExecutor` (core/multiproc_executor.py) drives one worker process per rank;
`NullExecutor` answers every step at once without torch (front-end benchmarks and tests).
Torch is imported lazily, inside the worker, so `tidal.core` stays importable without it.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np

from tidal.protocol.config import EngineConfig, ResolvedEngineInfo, read_model_limits, resolve_max_model_len
from tidal.protocol.messages import ModelRunnerOutput, SchedulerOutput
from tidal.protocol.sizing import max_useful_kv_blocks
from tidal.worker.spec_decode import grammar_proposal_rows  # torch-free: the bitmask's row layout


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def create(config: EngineConfig) -> "Executor":
        if config.model_runner == "null":
            return NullExecutor(config)
        if config.distributed_executor_backend == "ray":
            from tidal.core.ray_executor import RayExecutor

            return RayExecutor(config)
        if config.distributed_executor_backend == "uni" and config.tensor_parallel_size > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank; tensor_parallel_size="
                             f"{config.tensor_parallel_size} needs 'mp' or 'ray'")
        if config.tensor_parallel_size > 1:
            from tidal.core.multiproc_executor import MultiprocExecutor

            return MultiprocExecutor(config)
        return UniProcExecutor(config)

    @abstractmethod
    def initialize(self) -> ResolvedEngineInfo:
        """Load the model, size and allocate the KV cache; return the final limits."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def check_health(self) -> None:
        """Raise if a worker is gone (the busy loop calls this when idle)."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def initialize(self) -> ResolvedEngineInfo:
        from tidal.worker.worker import Worker

        self.worker = Worker(self.config, rank=0, world_size=1)
        return self.worker.initialize()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        out = self.worker.execute_model(scheduler_output)
        assert out is not None
        return out

    def shutdown(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.shutdown()


class NullExecutor(Executor):
    """Returns a token for every request whose chunk reaches its end, computed from
    (position, request id) alone; costs no model time, so what is measured is the engine."""

    def initialize(self) -> ResolvedEngineInfo:
        cfg = self.config
        self.vocab_size, max_pos = read_model_limits(cfg.model, cfg.disable_sliding_window)
        max_model_len = resolve_max_model_len(cfg.max_model_len, max_pos)
        blocks = cfg.num_kv_blocks or max_useful_kv_blocks(cfg.max_num_seqs, max_model_len, cfg.block_size)
        self._lens: dict[str, int] = {}  # req_id -> tokens known to the runner
        return ResolvedEngineInfo(max_model_len, blocks, cfg.block_size, self.vocab_size)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        lens = self._lens
        for rid in so.finished_req_ids:
            lens.pop(rid, None)
        for new in so.scheduled_new_reqs:
            lens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
        for cached in so.scheduled_cached_reqs:
            lens[cached.req_id] += len(cached.new_token_ids)
        computed = {n.req_id: n.num_computed_tokens for n in so.scheduled_new_reqs}
        computed.update((c.req_id, c.num_computed_tokens) for c in so.scheduled_cached_reqs)
        req_ids = list(so.num_scheduled_tokens)
        grammar_rows = {rid: i for i, rid in enumerate(so.structured_output_request_ids)}
        spec = so.scheduled_spec_decode_tokens
        # Constrained requests' proposal rows are masked too (after their first rows' masks).
        proposal_rows = grammar_proposal_rows(grammar_rows, spec) if spec and grammar_rows else {}
        sampled: list[list[int]] = []
        for rid in req_ids:
            drafts = spec.get(rid, ()) if spec else ()
            end = computed[rid] + so.num_scheduled_tokens[rid] - len(drafts)
            # Tokens 3.. of the vocabulary; deterministic in the position so a preempted and
            # recomputed request continues exactly.
            token = self._token(rid, end)
            if rid in grammar_rows and so.grammar_bitmask is not None:  # structured outputs
                token = _allowed_from(so.grammar_bitmask[grammar_rows[rid]], token, self.vocab_size)
            out = [token] if end >= lens[rid] else []
            # Proposals: accepted while each equals the token of its position (exact match).
            for j, draft in enumerate(drafts if out else ()):
                if draft != out[-1]:
                    break
                token = self._token(rid, end + j + 1)
                if rid in proposal_rows and so.grammar_bitmask is not None:
                    token = _allowed_from(so.grammar_bitmask[proposal_rows[rid] + j], token, self.vocab_size)
                out.append(token)
            sampled.append(out)
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled)

    def _token(self, rid: str, end: int) -> int:
        return 3 + (end * 7919 + len(rid)) % (self.vocab_size - 3)


def _allowed_from(words: np.ndarray, token: int, vocab_size: int) -> int:
    """The first token at or after `token` (wrapping) that the packed bitmask row allows."""
    allowed = np.flatnonzero(np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size])
    if not len(allowed):
        return token
    return int(allowed[np.searchsorted(allowed, token) % len(allowed)])
