"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from tidal.protocol.config import SUPPORTED_ARCHITECTURES

from tidal.worker.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from tidal.worker.models.gpt_oss import GptOssForCausalLM
from tidal.worker.models.llama import (
    LlamaForCausalLM,
    MistralForCausalLM,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from tidal.worker.models.moe import MixtralForCausalLM, Qwen3MoeForCausalLM
from tidal.worker.models.phi3 import Phi3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "GptOssForCausalLM": GptOssForCausalLM,
}


assert set(MODEL_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(hf_config: Any) -> type[nn.Module]:
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture(s) {architectures or '(none in config)'}; "
        f"supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
