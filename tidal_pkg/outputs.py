"""vLLM's `vllm.outputs` names."""
from tidal.protocol.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "RequestOutput"]
