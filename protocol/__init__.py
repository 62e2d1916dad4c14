"""The contract between tidal's processes and with its users (no torch here)."""
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo
from tidal.protocol.errors import EngineDeadError, EngineGenerateError
from tidal.protocol.outputs import CompletionOutput, Logprob, RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams

__all__ = [
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineGenerateError",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "ResolvedEngineInfo",
    "SamplingParams",
]
