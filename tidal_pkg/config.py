"""vLLM's `vllm.config` names: tidal's EngineConfig is its VllmConfig (it answers `.model_config`,
`.cache_config`, ... with these views)."""
from __future__ import annotations

from typing import Any

from tidal.protocol.config import EngineConfig as VllmConfig
from tidal.protocol.config_views import CacheConfig, DeviceConfig, ParallelConfig, SchedulerConfig
from tidal.protocol.config_views import ModelConfig as _ModelConfigView


class ModelConfig(_ModelConfigView):
    """vLLM's ModelConfig: the view of an engine's config (`llm.model_config`), or one made on
    its own from engine args as vLLM's tests and tools make one
    (`ModelConfig(model=PATH, tokenizer=..., dtype=..., seed=0, max_model_len=...)`); an
    argument that is not an engine arg is a TypeError naming it, as EngineArgs gives."""

    def __init__(self, model: Any = None, **kwargs: Any) -> None:
        if isinstance(model, VllmConfig) and not kwargs:
            super().__init__(model)
            return
        if model is None:
            raise TypeError("ModelConfig() needs model= (a checkpoint directory) or an engine's config")
        from tidal.frontend.engine_args import EngineArgs  # the library, only when made on its own

        super().__init__(EngineArgs(model=model, **kwargs).create_engine_config())


__all__ = ["VllmConfig", "ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig", "DeviceConfig"]
