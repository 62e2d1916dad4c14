"""vLLM's `vllm.sampling_params` names (`from tidal.sampling_params import SamplingParams`)."""
from tidal.protocol.beam_search import BeamSearchParams
from tidal.protocol.sampling_params import RequestOutputKind, SamplingParams
from tidal.protocol.structured_outputs import StructuredOutputsParams

__all__ = ["BeamSearchParams", "RequestOutputKind", "SamplingParams", "StructuredOutputsParams"]
