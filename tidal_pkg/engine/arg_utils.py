"""vLLM's `vllm.engine.arg_utils` names."""
from tidal.frontend.engine_args import AsyncEngineArgs, EngineArgs

__all__ = ["AsyncEngineArgs", "EngineArgs"]
