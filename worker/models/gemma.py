"""Gemma 2 and Gemma 3 (text): what transformers' Gemma2ForCausalLM / Gemma3ForCausalLM differ
from Llama in.

- Embeddings are scaled by sqrt(hidden_size), that factor rounded to the model's dtype first
  (transformers: `embed_scale.to(weight.dtype)`, 55.4256 -> 55.5 in bf16).
- RMSNorm scales by (1 + weight), in float32 (layers/layernorm.GemmaRMSNorm); each layer has
  four of them: before and after attention, before and after the MLP (the "sandwich"), and the
  residual adds come after the post-norms.
- The MLP is GeGLU: gelu(gate) * up with `hidden_activation` (gelu_pytorch_tanh).
- Attention scales by query_pre_attn_scalar**-0.5, not head_dim**-0.5, and soft-caps its scores
  (`attn_logit_softcapping`: cap * tanh(s / cap) before the mask; every attention backend does
  it, see attention_backends.AttentionBackend). The logits are soft-capped too
  (`final_logit_softcapping`).
- Local (sliding-window) and global layers interleave by `layer_types`
  (protocol/sliding_window.py: each layer gets its own window; the engine core frees KV blocks
  behind a window only when every layer slides, which a Gemma never does).
- Gemma 3 adds per-head q/k RMSNorms (1 + weight) before RoPE, and two RoPE tables: local
  layers rotate by `rope_parameters["sliding_attention"]` (rope_local_base_freq, no scaling),
  global ones by `rope_parameters["full_attention"]` (rope_theta with its scaling: linear x8 on
  the 4B and larger). Gemma 3's `attn_logit_softcapping` is null in every published config;
  when a config sets it, tidal applies it (as Gemma 2 and Google's reference implementation
  do), whereas transformers 5 (and vLLM) build Gemma 3's attention without it.
- Gemma3ForConditionalGeneration checkpoints are served text-only: the worker reads their
  text_config (worker/hf_config.py), the language model's weights load from under
  `language_model.` (or transformers 5's `model.language_model.`) and the vision tower's are
  skipped. The text model is Gemma3ForCausalLM's, soft caps included when set (transformers 5's
  multimodal class applies neither cap; the published configs set both null).

What would change the output and tidal does not implement is refused (check_gemma_config):
bidirectional attention (use_bidirectional_attention), other activations, other layer types.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from tidal.protocol.config import config_positions
from tidal.protocol.sliding_window import gemma_layer_types, layer_sliding_windows
from tidal.worker.attention import Attention
from tidal.worker.layers.activation import GeluAndMul
from tidal.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.worker.layers.layernorm import GemmaRMSNorm
from tidal.worker.layers.linear import (
    LoadedWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from tidal.worker.layers.qk_norm_rope import QKNormRope
from tidal.worker.layers.rotary import RotaryEmbedding, rope_params_from_config
from tidal.worker.models.llama import LlamaForCausalLM

# transformers' ACT2FN names -> torch's gelu approximation.
_GELU_APPROXIMATE = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}
# transformers' defaults (Gemma3TextConfig.default_theta) for a config without rope_parameters.
_GEMMA3_DEFAULT_THETA = {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}


def check_gemma_config(config: Any, arch: str) -> None:
    """Refuse config fields tidal would otherwise ignore although they change the output."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: use_bidirectional_attention=True (an embedding model's non-causal "
                         f"attention) is not supported by tidal")
    act = _activation(config)
    if act not in _GELU_APPROXIMATE:
        raise ValueError(f"{arch}: unsupported hidden_activation {act!r}; tidal supports "
                         f"{', '.join(_GELU_APPROXIMATE)}")
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        cap = getattr(config, field, None)
        if cap is not None and not float(cap) > 0:
            raise ValueError(f"{arch}: {field}={cap!r} must be > 0 or null")
    gemma_layer_types(config)  # unknown layer types raise


def _activation(config: Any) -> str:
    # transformers' Gemma 2/3 read hidden_activation only (older Gemma configs also carry
    # hidden_act, which those classes ignore).
    return getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"


def _softcap(config: Any, field: str) -> float | None:
    cap = getattr(config, field, None)
    return None if cap is None else float(cap)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_activation: str) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)
        self.act_fn = GeluAndMul(_GELU_APPROXIMATE[hidden_activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class GemmaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        head_dim = rotary_emb.head_size
        bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, total_num_heads, total_num_kv_heads, bias=bias)
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.qk_norm_rope = QKNormRope(rotary_emb, num_heads, num_kv_heads,
                                       config.rms_norm_eps if qk_norm else None, norm_cls=GemmaRMSNorm)
        scale = float(getattr(config, "query_pre_attn_scalar", None) or head_dim) ** -0.5
        self.attn = Attention(num_heads, head_dim, scale, num_kv_heads, sliding_window=sliding_window,
                              logits_soft_cap=_softcap(config, "attn_logit_softcapping"))
        self.o_proj = RowParallelLinear(total_num_heads * head_dim, config.hidden_size, bias=bias)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qk_norm_rope(positions, self.qkv_proj(hidden_states))
        return self.o_proj(self.attn(q, k, v))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None, qk_norm: bool) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.self_attn = GemmaAttention(config, rotary_emb, sliding_window, qk_norm)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size, _activation(config))
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps=eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        # As transformers' Gemma2DecoderLayer: the residual adds follow the post-norms, in the
        # model dtype.
        attn = self.self_attn(positions, self.input_layernorm(hidden_states))
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rotary(config: Any, head_dim: int, theta: float, scaling: dict[str, Any] | None) -> RotaryEmbedding:
    return RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, theta, scaling,
                           num_positions=config_positions(config))


def gemma3_rope_params(config: Any, layer_type: str) -> tuple[float, dict[str, Any] | None]:
    """(base, scaling or None) of Gemma 3's layers of `layer_type`: transformers 5's per-type
    `rope_parameters`, or (a config without them) rope_local_base_freq unscaled for the local
    layers and rope_theta with rope_scaling for the global ones, as Gemma3TextConfig reads them."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        own = dict(params[layer_type] or {})
        own.setdefault("rope_theta", _GEMMA3_DEFAULT_THETA[layer_type])
        return rope_params_from_config(SimpleNamespace(rope_parameters=own))
    if layer_type == "sliding_attention":
        return float(getattr(config, "rope_local_base_freq", None) or _GEMMA3_DEFAULT_THETA[layer_type]), None
    theta = getattr(config, "rope_theta", None) or _GEMMA3_DEFAULT_THETA[layer_type]
    scaling = getattr(config, "rope_scaling", None)
    return rope_params_from_config(SimpleNamespace(rope_theta=theta, rope_scaling=scaling))


class GemmaModel(nn.Module):
    def __init__(self, config: Any, qk_norm: bool, per_type_rope: bool) -> None:
        """qk_norm / per_type_rope: Gemma 3's q/k norms and its local / global RoPE tables."""
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        # sqrt(hidden_size) in the model's dtype (the default dtype the loader builds in).
        self.register_buffer("normalizer", torch.tensor(config.hidden_size**0.5), persistent=False)
        head_dim = _head_dim(config)
        layer_types = gemma_layer_types(config)
        if per_type_rope:
            ropes = {t: _rotary(config, head_dim, *gemma3_rope_params(config, t)) for t in sorted(set(layer_types))}
        else:  # one table for every layer
            rope = _rotary(config, head_dim, *rope_params_from_config(config))
            ropes = {t: rope for t in sorted(set(layer_types))}
        self.rotary_embs = nn.ModuleDict(ropes)
        windows = layer_sliding_windows(config)
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(config, ropes[t], w, qk_norm) for t, w in zip(layer_types, windows, strict=True))
        self.norm = GemmaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        hidden_states = hidden_states * self.normalizer.to(hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Loads as LlamaForCausalLM does (the same fused q/k/v and gate/up mapping, q/k norms into
    QKNormRope); the model is GemmaModel."""

    _qk_norm = False
    _per_type_rope = False

    def __init__(self, hf_config: Any) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM's: another decoder
        check_gemma_config(hf_config, type(self).__name__)
        self.config = hf_config
        self.model = GemmaModel(hf_config, self._qk_norm, self._per_type_rope)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        self.final_logit_softcapping = _softcap(hf_config, "final_logit_softcapping")

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.compute_logits(hidden_states)
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    _qk_norm = True
    _per_type_rope = True


# Checkpoint prefixes of Gemma3ForConditionalGeneration's language model (the hub's layout, and
# the one transformers 5 saves) -> Gemma3ForCausalLM's names; the vision tower's are skipped.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """A Gemma 3 multimodal checkpoint served text-only: its language model (text_config) with
    the weights under `language_model.`; image inputs are not supported (tidal takes text and
    token ids only)."""

    def __init__(self, hf_config: Any) -> None:
        # worker/hf_config.py hands over text_config already; a full Gemma3Config works too.
        text = getattr(hf_config, "text_config", None)
        super().__init__(text if text is not None else hf_config)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        def language_model() -> Iterator[tuple[str, LoadedWeight]]:
            for name, weight in weights:
                if name.startswith(_VISION_PREFIXES):
                    continue
                for prefix, ours in _LANGUAGE_MODEL_PREFIXES:
                    if name.startswith(prefix):
                        name = ours + name[len(prefix):]
                        break
                yield name, weight

        return super().load_weights(language_model())
