"""Llama family: Llama / Mistral, Qwen2 (qkv bias), Qwen3 (per-head q/k RMSNorm).

Inputs are flattened over the batch ([T] token ids and positions); attention metadata comes
from the forward context set by the model runner.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tidal.protocol.config import config_positions
from tidal.protocol.sliding_window import layer_sliding_windows
from tidal.worker.attention import Attention
from tidal.worker.layers.activation import SiluAndMul
from tidal.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.worker.layers.layernorm import RMSNorm
from tidal.worker.layers.linear import (
    LoadedWeight,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from tidal.worker.layers.qk_norm_rope import QKNormRope
from tidal.worker.layers.rotary import RotaryEmbedding, rope_params_from_config, rotary_dim_from_config

logger = logging.getLogger(__name__)


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool = False) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only silu is supported")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


@dataclass(frozen=True)
class AttentionOptions:
    """How a family's attention differs from Llama's, as its HF class builds it."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each q/k head before RoPE


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, opts: AttentionOptions) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        total_num_heads = config.num_attention_heads
        total_num_kv_heads = getattr(config, "num_key_value_heads", None) or total_num_heads
        head_dim = rotary_emb.head_size  # LlamaModel read it from the config
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, total_num_heads, total_num_kv_heads,
                                          bias=opts.qkv_bias)
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.qk_norm_rope = QKNormRope(rotary_emb, num_heads, num_kv_heads,
                                       config.rms_norm_eps if opts.qk_norm else None)
        self.attn = Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads)
        self.o_proj = RowParallelLinear(total_num_heads * head_dim, hidden_size, bias=opts.o_bias)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qk_norm_rope(positions, self.qkv_proj(hidden_states))
        return self.o_proj(self.attn(q, k, v))


# (config, layer index) -> the layer's feed-forward block, or None for the dense LlamaMLP
# (mixture-of-experts families put their MoE block on some or all layers).
MLPFactory = Callable[[Any, int], "nn.Module | None"]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, opts: AttentionOptions,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, rotary_emb, opts)
        self.mlp = mlp if mlp is not None else LlamaMLP(
            config.hidden_size,
            config.intermediate_size,
            getattr(config, "hidden_act", "silu"),
            bias=bool(getattr(config, "mlp_bias", False)),
        )
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, hidden_states: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, opts: AttentionOptions, make_mlp: MLPFactory | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope_theta, rope_scaling = rope_params_from_config(config)
        self.rotary_emb = RotaryEmbedding(head_dim, rotary_dim_from_config(config, head_dim),
                                          config.max_position_embeddings, rope_theta, rope_scaling,
                                          getattr(config, "original_max_position_embeddings", None),
                                          num_positions=config_positions(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.rotary_emb, opts, make_mlp(config, i) if make_mlp else None)
            for i in range(config.num_hidden_layers))
        # Mistral / Qwen2 / Qwen3 sliding layers (the rule the engine core frees KV blocks by).
        for layer, window in zip(self.layers, layer_sliding_windows(config), strict=True):
            layer.self_attn.attn.sliding_window = window
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # (our param name, checkpoint name, shard id): fused projections take their parts by shard
    # id; shard id None is a plain rename (the q/k norms live in the QKNormRope layer).
    packed_modules_mapping: list[tuple[str, str, str | int | None]] = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
        (".qk_norm_rope.q_norm", ".q_norm", None),
        (".qk_norm_rope.k_norm", ".k_norm", None),
    ]

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.config = hf_config
        self.model = LlamaModel(hf_config, self._attention_options(hf_config), self._make_mlp)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    @staticmethod
    def _attention_options(config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias)

    @staticmethod
    def _make_mlp(config: Any, layer_idx: int) -> nn.Module | None:
        return None  # every layer dense

    def _param_name(self, name: str) -> tuple[str, Any]:
        """Checkpoint name -> (our parameter's name, shard id for its weight_loader)."""
        for fused, original, shard_id in self.packed_modules_mapping:
            if original in name:
                return name.replace(original, fused), shard_id
        return name, None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, LoadedWeight]]) -> set[str]:
        """Load HF-named weights; returns the names of the parameters that were loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, weight in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or "rotary_emb.sin_cached" in name:
                continue
            if name == "lm_head.weight" and self.tie_word_embeddings:
                continue  # some checkpoints store the tied copy anyway
            param_name, shard_id = self._param_name(name)
            param = params.get(param_name)
            if param is None:
                logger.warning("ignoring unexpected checkpoint weight %s", name)
                continue
            weight_loader = getattr(param, "weight_loader", default_weight_loader)
            weight_loader(param, weight, shard_id)
            loaded.add(param_name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing weights for: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _attention_options(config: Any) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True)  # HF Qwen2: q/k/v have bias, o_proj has none


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def _attention_options(config: Any) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
