"""vLLM's `vllm.config` names: tidal's EngineConfig is its VllmConfig (it answers `.model_config`,
`.cache_config`, ... with these views)."""
from tidal.protocol.config import EngineConfig as VllmConfig
from tidal.protocol.config_views import CacheConfig, DeviceConfig, ModelConfig, ParallelConfig, SchedulerConfig

__all__ = ["VllmConfig", "ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig", "DeviceConfig"]
