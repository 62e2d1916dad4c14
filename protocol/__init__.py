"""The contract between tidal's processes and with its users (no torch here)."""
from tidal.protocol.beam_search import BeamSearchOutput, BeamSearchParams, BeamSearchSequence
from tidal.protocol.config import EngineConfig, ResolvedEngineInfo, VllmConfig
from tidal.protocol.errors import (EngineDeadError, EngineGenerateError, EngineOverloadedError, EngineRestartingError,
                                   InvalidRequestError)
from tidal.protocol.outputs import CompletionOutput, FlatLogprobs, Logprob, RequestOutput
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams
from tidal.protocol.structured_outputs import StructuredOutputsParams

__all__ = [
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "EngineConfig",
    "EngineDeadError",
    "EngineGenerateError",
    "EngineOverloadedError",
    "EngineRestartingError",
    "InvalidRequestError",
    "FlatLogprobs",
    "Logprob",
    "RequestOutput",
    "RequestOutputKind",
    "ResolvedEngineInfo",
    "SamplingParams",
    "StructuredOutputsParams",
    "VllmConfig",
]
