"""gpt-oss (transformers' GptOssForCausalLM): what it differs from a Llama-shaped MoE decoder in.

- Attention has biases on q/k/v/o and one learned sink logit per query head (`self_attn.sinks`):
  it joins every softmax's denominator and attends to nothing, so a row's weights sum to less
  than 1 (every attention backend takes `sinks`; see AttentionBackend.forward).
- Layers alternate sliding-window (`sliding_attention`, from layer 0) and full attention by
  `layer_types` (protocol/sliding_window.py; the KV cache frees nothing: full layers read all).
- RoPE is YaRN (factor 32 over a 4096 context in the published configs, `truncate` false).
- Every layer's feed-forward block is a mixture of experts: a router with a bias (top-k of the
  logits, softmax over those k: FusedMoE's renormalized top-k of the full softmax is the same),
  experts with biases and a clamped SwiGLU: gate clamped above at `swiglu_limit`, up clamped to
  +-limit, out = (up + 1) * gate * sigmoid(alpha * gate), alpha = `swiglu_alpha` (1.702).
- The checkpoint stacks every expert, transposed and with gate / up interleaved:
  `experts.gate_up_proj` [E, H, 2I] (gate columns 0::2, up 1::2), `gate_up_proj_bias` [E, 2I],
  `experts.down_proj` [E, I, H], `down_proj_bias` [E, H]; they are re-laid into FusedMoE's
  w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I] at load.

The published checkpoints store the experts in MXFP4 (`*_blocks` / `*_scales`), which tidal
cannot read: they are refused with a clear error (protocol.config.check_checkpoint_quantization);
bf16 (or fp32) checkpoints of the same models load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tidal.protocol.config import check_checkpoint_quantization, config_positions
from tidal.protocol.sliding_window import gemma_layer_types, layer_sliding_windows
from tidal.worker.attention import Attention
from tidal.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.worker.layers.fused_moe import FusedMoE
from tidal.worker.layers.gemm import linear
from tidal.worker.layers.layernorm import RMSNorm
from tidal.worker.layers.linear import (
    LoadedWeight,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    copy_checked,
    weight_shape,
)
from tidal.worker.layers.qk_norm_rope import QKNormRope
from tidal.worker.layers.rotary import RotaryEmbedding, rope_params_from_config
from tidal.worker.models.llama import LlamaForCausalLM
from tidal.worker.parallel_state import get_tp_rank

# Checkpoint names of the stacked expert tensors -> our parameters.
_EXPERT_PARAMS = {
    ".experts.gate_up_proj_bias": ".experts.w13_bias",
    ".experts.gate_up_proj": ".experts.w13_weight",
    ".experts.down_proj_bias": ".experts.w2_bias",
    ".experts.down_proj": ".experts.w2_weight",
}


def check_gpt_oss_config(config: Any) -> None:
    """Refuse what tidal cannot run faithfully: MXFP4 weights, unknown layer types."""
    quant = getattr(config, "quantization_config", None)
    if quant is not None:
        check_checkpoint_quantization({"quantization_config": quant})
    gemma_layer_types(config)  # unknown layer types or a wrong count raise


def _expert_tensor(loaded: LoadedWeight, expert: int) -> torch.Tensor:
    """Expert `expert`'s slice of a stacked [E, ...] tensor, reading only it from a safetensors
    slice (a layer's stacked experts are a GB in bf16 at gpt-oss-20b's size)."""
    return loaded[expert] if isinstance(loaded, torch.Tensor) else loaded[expert : expert + 1][0]


class GptOssExperts(FusedMoE):
    """FusedMoE with biases on both projections and gpt-oss's clamped SwiGLU; loads the
    checkpoint's stacked, transposed, interleaved tensors (see the module docstring)."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 alpha: float, limit: float) -> None:
        # renormalize: a softmax over the top-k logits is the full softmax's top-k rescaled.
        super().__init__(num_experts, top_k, hidden_size, intermediate_size, renormalize=True)
        self.alpha = float(alpha)
        self.limit = float(limit)
        i_local = self.intermediate_size_per_partition
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * i_local), requires_grad=False)
        # Whole on every rank; only rank 0 adds it (the ranks' partial sums are all-reduced).
        self.w2_bias = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias):
            param.weight_loader = self.gpt_oss_weight_loader  # type: ignore[attr-defined]

    def gpt_oss_weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        """One of the four stacked checkpoint tensors into `param`: this rank's intermediate
        columns of every expert, gate / up de-interleaved, weights transposed."""
        e_total, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        i_local = self.intermediate_size_per_partition
        cols = slice(self.tp_rank * i_local, (self.tp_rank + 1) * i_local)
        want = {id(self.w13_weight): (e_total, h, 2 * i), id(self.w2_weight): (e_total, i, h),
                id(self.w13_bias): (e_total, 2 * i), id(self.w2_bias): (e_total, h)}[id(param)]
        if weight_shape(loaded) != want:
            raise ValueError(f"{type(self).__name__}: stacked checkpoint tensor has shape "
                             f"{weight_shape(loaded)}, expected {want}")
        what = f"{type(self).__name__} expert"
        for e in range(e_total):
            t = _expert_tensor(loaded, e)
            dst = param.data[e]
            if param is self.w13_weight:  # [H, 2I] -> gate rows then up rows of [2 * i_local, H]
                copy_checked(dst[:i_local], t[:, 0::2][:, cols].t(), what)
                copy_checked(dst[i_local:], t[:, 1::2][:, cols].t(), what)
            elif param is self.w13_bias:
                copy_checked(dst[:i_local], t[0::2][cols], what)
                copy_checked(dst[i_local:], t[1::2][cols], what)
            elif param is self.w2_weight:  # [I, H] -> [H, i_local]
                copy_checked(dst, t[cols].t(), what)
            else:
                copy_checked(dst, t, what)

    def _swiglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        # transformers' GptOssExperts._apply_gate, in its order of operations.
        gate, up = gate_up.chunk(2, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        w13 = None if self.w13_weight is None else self.w13_weight[expert]
        w2 = None if self.w2_weight is None else self.w2_weight[expert]
        h = self._swiglu(linear(x, w13, self.packed_w13[expert], self.w13_bias[expert]))
        down_bias = self.w2_bias[expert] if self.tp_rank == 0 else None
        return linear(h, w2, self.packed_w2[expert], down_bias)


class GptOssMLP(nn.Module):
    """`router` (replicated, with a bias) and `experts`: transformers' names."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.router = ReplicatedLinear(config.hidden_size, config.num_local_experts, bias=True)
        self.experts = GptOssExperts(config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
                                     config.intermediate_size, getattr(config, "swiglu_alpha", 1.702),
                                     getattr(config, "swiglu_limit", 7.0))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.router(hidden_states))


class GptOssAttention(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        head_dim = rotary_emb.head_size
        bias = bool(getattr(config, "attention_bias", True))  # GptOssConfig's default
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, total_heads, total_kv_heads, bias=bias)
        num_heads, num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.qk_norm_rope = QKNormRope(rotary_emb, num_heads, num_kv_heads, None)
        self.attn = Attention(num_heads, head_dim, head_dim**-0.5, num_kv_heads, sliding_window=sliding_window)
        self.o_proj = RowParallelLinear(total_heads * head_dim, config.hidden_size, bias=bias)
        # This rank's heads' sinks (tensor parallelism splits the query heads).
        self.head_start = get_tp_rank() * num_heads
        self.sinks = nn.Parameter(torch.empty(num_heads), requires_grad=False)
        self.sinks.weight_loader = self._load_sinks  # type: ignore[attr-defined]

    def _load_sinks(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        n = param.shape[0]
        total = weight_shape(loaded)
        if len(total) != 1 or total[0] < self.head_start + n:
            raise ValueError(f"self_attn.sinks: checkpoint tensor has shape {total}, expected one value per head")
        copy_checked(param.data, loaded[self.head_start : self.head_start + n], "self_attn.sinks")

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qk_norm_rope(positions, self.qkv_proj(hidden_states))
        return self.o_proj(self.attn(q, k, v, sinks=self.sinks))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config: Any, rotary_emb: RotaryEmbedding, sliding_window: int | None) -> None:
        super().__init__()
        self.self_attn = GptOssAttention(config, rotary_emb, sliding_window)
        self.mlp = GptOssMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        # Pre-norm residual blocks, as LlamaDecoderLayer (the adds in the model dtype, as HF's).
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class GptOssModel(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        theta, scaling = rope_params_from_config(config)
        self.rotary_emb = RotaryEmbedding(head_dim, head_dim, config.max_position_embeddings, theta, scaling,
                                          num_positions=config_positions(config))
        self.layers = nn.ModuleList(GptOssDecoderLayer(config, self.rotary_emb, window)
                                    for window in layer_sliding_windows(config))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class GptOssForCausalLM(LlamaForCausalLM):
    """Loads as LlamaForCausalLM does (q/k/v fused into qkv_proj, the rest by name), the
    stacked experts mapped onto GptOssExperts' parameters; the model is GptOssModel."""

    def __init__(self, hf_config: Any) -> None:
        nn.Module.__init__(self)  # not LlamaForCausalLM's: another decoder
        check_gpt_oss_config(hf_config)
        self.config = hf_config
        self.model = GptOssModel(hf_config)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def _param_name(self, name: str) -> tuple[str, Any]:
        for original, ours in _EXPERT_PARAMS.items():
            if name.endswith(original):
                return name[: -len(original)] + ours, None
        return super()._param_name(name)
