"""vLLM's `vllm.v1.engine.exceptions` names."""
from tidal.protocol.errors import EngineDeadError, EngineGenerateError, EngineRestartingError

__all__ = ["EngineDeadError", "EngineGenerateError", "EngineRestartingError"]
