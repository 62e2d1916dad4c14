"""Mixture-of-experts members of the Llama family: Qwen3-MoE and Mixtral.

Both are the Llama decoder (worker/models/llama.py) with a sparse MoE block in place of the
dense MLP on some (Qwen3-MoE: `decoder_sparse_step`, `mlp_only_layers`) or all (Mixtral) layers.
Attention is Qwen3's (per-head q/k RMSNorm) and Mistral's respectively.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tidal.worker.layers.fused_moe import FusedMoE
from tidal.worker.layers.linear import ReplicatedLinear
from tidal.worker.models.llama import MistralForCausalLM, Qwen3ForCausalLM

# One expert's tensor in the HF hub layout (Mixtral's `block_sparse_moe.` renamed to `mlp.`
# first, as transformers 5 does): gate/up rows of w13, down into w2.
_EXPERT_WEIGHT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
# Every expert stacked in one tensor, as transformers 5 holds them (experts.gate_up_proj).
_STACKED_EXPERTS = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")
_SHARD_IDS = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}

# Config fields of related MoE families (Qwen2-MoE, DeepSeek, ...) that change the output and
# that these models do not implement, with the value that means "off".
_UNSUPPORTED_WHEN_SET: dict[str, Any] = {
    "shared_expert_intermediate_size": 0,
    "n_shared_experts": 0,
    "num_shared_experts": 0,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 0,
}


def check_moe_config(config: Any, arch: str) -> None:
    """Refuse config fields tidal would otherwise ignore although they change the output."""
    for field, off in _UNSUPPORTED_WHEN_SET.items():
        value = getattr(config, field, None)
        if value is not None and value != off:
            raise ValueError(f"{arch}: config field {field}={value!r} is not supported by tidal "
                             f"(only {field}={off!r} or absent)")
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"{arch}: unsupported hidden_act {hidden_act!r}; only silu is supported")


class SparseMoeBlock(nn.Module):
    """Router (`gate`, replicated on every rank) and the experts (`experts`), HF's names."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool) -> None:
        super().__init__()
        self.gate = ReplicatedLinear(hidden_size, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, top_k, hidden_size, intermediate_size, renormalize)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class _SparseMoeMixin:
    """Mixed in before a LlamaForCausalLM subclass: refuses MoE config fields it does not
    implement, and maps the experts' checkpoint names onto FusedMoE's stacked parameters (the
    subclass's own mapping handles everything else)."""

    def __init__(self, hf_config: Any) -> None:
        check_moe_config(hf_config, type(self).__name__)
        super().__init__(hf_config)  # type: ignore[call-arg]

    def _param_name(self, name: str) -> tuple[str, Any]:
        name = name.replace(".block_sparse_moe.", ".mlp.")
        m = _EXPERT_WEIGHT.search(name)
        if m is not None:
            shard = _SHARD_IDS[m[2]]
            param = ".experts.w2_weight" if shard == "w2" else ".experts.w13_weight"
            return name[: m.start()] + param, (shard, int(m[1]))
        m = _STACKED_EXPERTS.search(name)
        if m is not None:
            param = ".experts.w13_weight" if m[1] == "gate_up_proj" else ".experts.w2_weight"
            return name[: m.start()] + param, None
        return super()._param_name(name)  # type: ignore[misc]


def qwen3_moe_is_sparse_layer(config: Any, layer_idx: int) -> bool:
    """transformers' Qwen3MoeDecoderLayer rule for which layers get the MoE block."""
    mlp_only = getattr(config, "mlp_only_layers", None) or []
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return layer_idx not in mlp_only and config.num_experts > 0 and (layer_idx + 1) % step == 0


class Qwen3MoeForCausalLM(_SparseMoeMixin, Qwen3ForCausalLM):
    @staticmethod
    def _make_mlp(config: Any, layer_idx: int) -> nn.Module | None:
        if not qwen3_moe_is_sparse_layer(config, layer_idx):
            return None  # dense LlamaMLP of config.intermediate_size, as HF's Qwen3MoeMLP
        return SparseMoeBlock(config.hidden_size, config.num_experts, config.num_experts_per_tok,
                              config.moe_intermediate_size, renormalize=bool(getattr(config, "norm_topk_prob", False)))


class MixtralForCausalLM(_SparseMoeMixin, MistralForCausalLM):
    @staticmethod
    def _make_mlp(config: Any, layer_idx: int) -> nn.Module | None:
        # Mixtral's router is a softmax over the top-k logits: the top-k of the full softmax,
        # renormalized.
        return SparseMoeBlock(config.hidden_size, config.num_local_experts, config.num_experts_per_tok,
                              config.intermediate_size, renormalize=True)
