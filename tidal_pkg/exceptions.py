"""vLLM's `vllm.exceptions` names."""
from tidal.protocol.errors import VLLMValidationError

__all__ = ["VLLMValidationError"]
