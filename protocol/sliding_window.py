"""Which attention layers of a model slide, and over how many positions: one rule for the
worker (what each layer attends) and the engine core (which KV blocks it may free), so the two
can never disagree. Plain Python over a config object (transformers' or a namespace over
config.json): no torch, no transformers.

A sliding layer of window W lets a query at position i attend keys j with i - W < j <= i
(transformers' `sliding_window_overlay`: W keys, the query's own included).
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace
from typing import Any

# Architectures whose HF attention slides on every layer whenever `sliding_window` is set.
_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
# Architectures whose HF classes read `use_sliding_window` / `max_window_layers` / `layer_types`.
_QWEN_STYLE = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Architectures whose HF classes interleave local (sliding) and global layers by `layer_types`,
# else by a fixed pattern: every `pattern`-th layer (1-based) is global. transformers' defaults:
# Gemma2Config alternates (2); Gemma3TextConfig reads `sliding_window_pattern` (6).
# GptOssConfig alternates like Gemma 2 (sliding from layer 0).
_INTERLEAVED = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "Gemma3ForConditionalGeneration": 6,
                "GptOssForCausalLM": 2}
_LAYER_TYPES = ("sliding_attention", "full_attention")
# config.json's model_type -> architecture, for configs that name no architectures.
_BY_MODEL_TYPE = {"mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
                  "gemma3": "Gemma3ForConditionalGeneration", "gpt_oss": "GptOssForCausalLM"}
# transformers' Qwen2Config / Qwen3Config default when config.json names no max_window_layers.
_DEFAULT_MAX_WINDOW_LAYERS = 28


def layer_sliding_windows(config: Any) -> list[int | None]:
    """Per decoder layer: its window, or None for full attention, as transformers 5 decides.

    Mistral, Mixtral, Phi-3: every layer slides when `sliding_window` is set (their attention
    ignores `layer_types`). Qwen2/Qwen3: nothing slides unless `use_sliding_window`; then `layer_types`
    when given, else the layers from `max_window_layers` on (the first ones stay full).
    Qwen3-MoE: every layer when `use_sliding_window`. Llama: never (LlamaConfig has no window).
    Gemma 2 / Gemma 3 / gpt-oss: the `sliding_attention` layers of `layer_types`, else (a config.json
    without them) transformers' default pattern: Gemma 2 alternates local / global from a local
    layer 0, Gemma 3 makes every `sliding_window_pattern`-th layer (default 6) global.
    """
    num_layers = int(config.num_hidden_layers)
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else _BY_MODEL_TYPE.get(getattr(config, "model_type", ""), "")
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * num_layers
    window = int(window)
    if arch in _INTERLEAVED:
        return [window if t == "sliding_attention" else None for t in gemma_layer_types(config)]
    if arch in _EVERY_LAYER:
        return [window] * num_layers
    if not getattr(config, "use_sliding_window", False):
        return [None] * num_layers
    if arch == "Qwen3MoeForCausalLM":
        return [window] * num_layers
    if arch not in _QWEN_STYLE:
        return [None] * num_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        first = getattr(config, "max_window_layers", None)
        first = _DEFAULT_MAX_WINDOW_LAYERS if first is None else int(first)
        return [window if i >= first else None for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    return [window if t == "sliding_attention" else None for t in layer_types]


def gemma_layer_types(config: Any) -> list[str]:
    """Per layer "sliding_attention" or "full_attention" for a Gemma 2 / Gemma 3 config: its
    `layer_types`, or the pattern transformers fills them from (see layer_sliding_windows)."""
    num_layers = int(config.num_hidden_layers)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        layer_types = list(layer_types)
        if len(layer_types) != num_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
        unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
        if unknown:
            raise ValueError(f"layer_types: unsupported layer type(s) {unknown} "
                             f"(tidal knows {', '.join(_LAYER_TYPES)})")
        return layer_types
    archs = getattr(config, "architectures", None) or []
    arch = archs[0] if archs else _BY_MODEL_TYPE.get(getattr(config, "model_type", ""), "")
    pattern = _INTERLEAVED.get(arch, 2)
    if arch not in ("Gemma2ForCausalLM", "GptOssForCausalLM"):  # their configs have no such field
        pattern = int(getattr(config, "sliding_window_pattern", None) or pattern)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


def kv_sliding_window(config: Any) -> int | None:
    """The window the KV cache may drop blocks behind: set only when every layer slides (a
    full layer needs every position, and tidal keeps one block table for all layers); the
    largest window when they differ, so no layer loses a position it reads."""
    windows = layer_sliding_windows(config)
    if not windows or any(w is None for w in windows):
        return None
    return max(w for w in windows if w is not None)


def model_kv_sliding_window(model: str) -> int | None:
    """kv_sliding_window of the checkpoint directory `model` from its config.json (the engine
    core's view, without transformers); None when there is none to read (the null runner's
    placeholder model) or it does not parse."""
    try:
        with open(os.path.join(model, "config.json"), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if isinstance(data, dict) and isinstance(data.get("text_config"), dict):
        # A multimodal checkpoint (Gemma3ForConditionalGeneration): its language model's layers.
        data = {**data["text_config"], "architectures": data.get("architectures")}
    if not isinstance(data, dict) or "num_hidden_layers" not in data:
        return None
    return kv_sliding_window(SimpleNamespace(**data))
