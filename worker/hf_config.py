"""The model's config.json as the worker needs it, without importing transformers when possible.

`transformers.AutoConfig` costs ~1.5 s of imports on this project's machines (transformers 5
scans every model package at import), on the engine core's start-up path, to read one JSON
file. The models read a handful of fields (see _READ_FIELDS); where config.json states every
field whose transformers default could differ from the model code's own fallback, a plain
namespace over the JSON is the same config. Otherwise (or with remote code) AutoConfig loads it.
tests/test_startup.py compares the two on every supported architecture.
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

# Fields every architecture's model code reads without a fallback of its own.
_REQUIRED = ("architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
             "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings")
# Fields whose transformers default (per config class) differs from the model code's fallback.
_REQUIRED_PER_ARCH: dict[str, tuple[str, ...]] = {
    "Qwen3ForCausalLM": ("head_dim", "sliding_window", "use_sliding_window"),
    "Qwen2ForCausalLM": ("sliding_window", "use_sliding_window"),
    "MistralForCausalLM": ("sliding_window",),
    "LlamaForCausalLM": (),
}
# What the models, the loader and the worker read (for the tests' comparison).
READ_FIELDS = (*_REQUIRED, "num_key_value_heads", "head_dim", "hidden_act", "mlp_bias", "attention_bias",
               "sliding_window", "use_sliding_window")


def _plain_config(model: str) -> SimpleNamespace | None:
    with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    archs = data.get("architectures") or []
    if "auto_map" in data or len(archs) != 1 or archs[0] not in _REQUIRED_PER_ARCH:
        return None
    if any(k not in data for k in (*_REQUIRED, *_REQUIRED_PER_ARCH[archs[0]])):
        return None
    if not any(k in data for k in ("rope_parameters", "rope_theta")):
        return None  # the default base differs per config class
    return SimpleNamespace(**data)


def load_hf_config(model: str, *, allow_plain: bool = True) -> Any:
    """The config of the local checkpoint `model`: a namespace over config.json where that is
    the same config (see the module docstring), else transformers' PretrainedConfig."""
    if not model or not os.path.isdir(model):
        raise ValueError(f"model directory {model!r} does not exist (tidal loads local checkpoints)")
    if not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"model directory {model!r} has no config.json")
    if allow_plain:
        plain = _plain_config(model)
        if plain is not None:
            return plain
    from transformers import AutoConfig

    return language_model_config(AutoConfig.from_pretrained(model))


# Multimodal architectures tidal serves text-only: their language model's config is the one the
# worker reads (the model class loads the text weights and skips the vision tower's).
_TEXT_ONLY = ("Gemma3ForConditionalGeneration",)


def language_model_config(config: Any) -> Any:
    """`config` itself, or for a multimodal checkpoint served text-only (_TEXT_ONLY) its
    text_config, naming the checkpoint's architecture and dtype (which only the outer config
    states) so that the registry, the loader and the dtype rule see what config.json says."""
    archs = list(getattr(config, "architectures", None) or [])
    text = getattr(config, "text_config", None)
    if text is None or not any(a in _TEXT_ONLY for a in archs):
        return config
    text.architectures = archs
    if getattr(text, "dtype", None) is None and getattr(config, "dtype", None) is not None:
        text.dtype = config.dtype
    return text
