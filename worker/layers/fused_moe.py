"""Fused mixture-of-experts layer (vLLM's `FusedMoE`): router top-k, tokens grouped by expert,
one GEMM per expert over its rows, outputs combined by router weight.

Expert weights are stacked at load into `w13_weight` [E, 2 * I, H] (each expert's gate rows,
then its up rows) and `w2_weight` [E, H, I], from the HF checkpoints' per-expert tensors
(`experts.{e}.gate_proj/up_proj/down_proj`, Mixtral's `experts.{e}.w1/w3/w2`) or from the
fused ones transformers 5 keeps in memory (`experts.gate_up_proj`, `experts.down_proj`).
Tensor parallel splits every expert's intermediate dimension I, as the dense MLP splits its
own: each rank holds [gate_shard; up_shard] of every expert and the partial sums of the down
projection are all-reduced once per layer, after the combine.

Grouping: the T * top_k (token, expert) pairs are sorted by expert once; each expert then runs
its GEMMs on one contiguous block of the gathered rows, so there is a Python loop over the
experts a step touches, never over tokens. On CPU each expert's weights are packed for
tidal's GEMM (worker/layers/gemm.py) like any linear layer's; on CUDA a Triton grouped GEMM
(worker/layers/fused_moe_triton.py) runs every expert in one launch; elsewhere `F.linear` runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tidal.worker.layers.activation import SiluAndMul
from tidal.worker.layers.gemm import PackedWeight, PanelWeight, linear, pack_if_enabled
from tidal.worker.layers.linear import LoadedWeight, copy_checked, divide, weight_shape
from tidal.worker.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce

# Per-expert checkpoint shard ids: gate (w1) and up (w3) rows of w13, down (w2).
_W13_SHARDS = ("w1", "w3")


def fused_topk(gating_output: torch.Tensor, topk: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax router: (weights [T, topk] float32, expert ids [T, topk] int64), best first.

    The softmax runs over all experts in float32, as transformers' routers do; `renormalize`
    rescales the top-k weights to sum to 1 (Qwen3-MoE's norm_topk_prob; always on for Mixtral,
    where it equals a softmax over the top-k logits)."""
    probs = torch.softmax(gating_output, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, topk, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def _expert_block(loaded: LoadedWeight, expert: int, dim: int, start: int, size: int) -> torch.Tensor:
    """expert's 2-D tensor of a stacked [E, ...] checkpoint tensor, narrowed to [start, start+size)
    on `dim` (0 rows, 1 columns), reading only that block from a safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded[expert].narrow(dim, start, size)
    if dim == 0:
        return loaded[expert : expert + 1, start : start + size][0]
    return loaded[expert : expert + 1, :, start : start + size][0]


class FusedMoE(nn.Module):
    """Experts of one MoE layer. forward(hidden [T, H], router_logits [T, E]) -> [T, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size  # per expert, whole (unsharded)
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size)
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        i_local = self.intermediate_size_per_partition
        # torch.empty: the loader (or dummy init) fills every element.
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * i_local, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden_size, i_local), requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.w2_weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        self.act_fn = SiluAndMul()
        # Per expert, the weight in the CPU GEMM's layout (process_weights_after_loading).
        self.packed_w13: list[PackedWeight | PanelWeight | None] = [None] * num_experts
        self.packed_w2: list[PackedWeight | PanelWeight | None] = [None] * num_experts

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        """shard_id ("w1" | "w3" | "w2", expert): one expert's [I, H] gate/up or [H, I] down
        tensor. None: every expert at once, stacked as transformers 5 holds them
        (gate_up_proj [E, 2 * I, H] into w13_weight, down_proj [E, H, I] into w2_weight)."""
        e_total, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        if shard_id is None:
            fused_w13 = param is self.w13_weight
            want = (e_total, 2 * i, h) if fused_w13 else (e_total, h, i)
            if weight_shape(loaded) != want:
                raise ValueError(f"{type(self).__name__}: stacked checkpoint tensor has shape "
                                 f"{weight_shape(loaded)}, expected {want}")
            for expert in range(e_total):
                for name in (_W13_SHARDS if fused_w13 else ("w2",)):
                    self._load_expert(param, loaded, name, expert, stacked=True)
            return
        name, expert = shard_id
        if not 0 <= expert < e_total:
            raise ValueError(f"{type(self).__name__}: checkpoint has expert {expert}, the config {e_total}")
        want = (h, i) if name == "w2" else (i, h)
        if weight_shape(loaded) != want:
            raise ValueError(f"{type(self).__name__}[{name}, expert {expert}]: checkpoint tensor has shape "
                             f"{weight_shape(loaded)}, expected {want}")
        self._load_expert(param, loaded, name, expert, stacked=False)

    def _load_expert(self, param: nn.Parameter, loaded: LoadedWeight, name: str, expert: int, stacked: bool) -> None:
        """Copy this rank's shard of expert `expert`'s `name` part into `param`."""
        i_local = self.intermediate_size_per_partition
        start = self.tp_rank * i_local
        if name == "w2":  # down: this rank's intermediate columns
            if stacked:
                shard = _expert_block(loaded, expert, 1, start, i_local)
            elif isinstance(loaded, torch.Tensor):
                shard = loaded.narrow(1, start, i_local)
            else:
                shard = loaded[:, start : start + i_local]
            copy_checked(param.data[expert], shard, f"{type(self).__name__}[w2, expert {expert}]")
            return
        part = _W13_SHARDS.index(name)  # gate rows first, then up, as SiluAndMul splits them
        if stacked:
            shard = _expert_block(loaded, expert, 0, part * self.intermediate_size + start, i_local)
        elif isinstance(loaded, torch.Tensor):
            shard = loaded.narrow(0, start, i_local)
        else:
            shard = loaded[start : start + i_local]
        copy_checked(param.data[expert].narrow(0, part * i_local, i_local), shard,
                     f"{type(self).__name__}[{name}, expert {expert}]")

    def process_weights_after_loading(self) -> None:
        """Pack every expert's two weights for the CPU GEMM, as LinearBase does for a linear
        layer; the stacked Parameters are dropped when all are packed (weights held once)."""
        if self.w13_weight is None:
            return
        packed13 = [pack_if_enabled(self.w13_weight[e]) for e in range(self.num_experts)]
        packed2 = [pack_if_enabled(self.w2_weight[e]) for e in range(self.num_experts)]
        if all(p is not None for p in (*packed13, *packed2)):
            self.packed_w13, self.packed_w2 = packed13, packed2
            self.w13_weight = None  # type: ignore[assignment]
            self.w2_weight = None  # type: ignore[assignment]

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = fused_topk(router_logits, self.top_k, self.renormalize)
        if (hidden_states.is_cuda and self.w13_weight is not None
                and type(self)._expert is FusedMoE._expert):  # gpt-oss's own experts keep the torch path
            from tidal.worker.layers.fused_moe_triton import fused_experts_triton

            final = fused_experts_triton(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        elif hidden_states.shape[0] == 1:
            final = self._forward_one_token(hidden_states, topk_weights, topk_ids)
        else:
            final = self._forward_grouped(hidden_states, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            final = tensor_model_parallel_all_reduce(final)
        return final

    def _expert(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """down(silu(gate x) * up x) of one expert over the rows x (this rank's shard)."""
        w13 = None if self.w13_weight is None else self.w13_weight[expert]
        w2 = None if self.w2_weight is None else self.w2_weight[expert]
        return linear(self.act_fn(linear(x, w13, self.packed_w13[expert])), w2, self.packed_w2[expert])

    def _forward_grouped(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                         topk_ids: torch.Tensor) -> torch.Tensor:
        flat_ids = topk_ids.flatten()
        # Sort the (token, slot) pairs by expert once; stable, so each expert's rows stay in
        # token order. order[j] is the pair at sorted row j; its token is order[j] // top_k.
        order = torch.argsort(flat_ids, stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of_row = order // self.top_k
        rows = hidden_states[token_of_row]
        outs: list[torch.Tensor] = []
        start = 0
        for expert, count in enumerate(counts):
            if count:
                outs.append(self._expert(expert, rows[start : start + count]))
                start += count
        if not outs:  # no tokens (a profile or padding-only run)
            return torch.zeros_like(hidden_states)
        out_rows = torch.cat(outs) if len(outs) != 1 else outs[0]
        out_rows *= topk_weights.flatten()[order].to(out_rows.dtype).unsqueeze(1)
        # Each token's slots are added in ascending expert order onto zeros (CPU index_add_
        # runs in index order): transformers' order, and one that does not depend on the rest
        # of the batch.
        final = torch.zeros_like(hidden_states, dtype=out_rows.dtype)
        return final.index_add_(0, token_of_row, out_rows)

    def _forward_one_token(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor,
                           topk_ids: torch.Tensor) -> torch.Tensor:
        """A decode step of one sequence: no sort, gather or scatter, which at one row cost as
        much as the expert GEMMs. Same order of additions as _forward_grouped."""
        slots = sorted(zip(topk_ids[0].tolist(), range(self.top_k)))
        final: torch.Tensor | None = None
        for expert, slot in slots:
            y = self._expert(expert, hidden_states)
            y *= topk_weights[:, slot : slot + 1].to(y.dtype)
            final = y if final is None else final.add_(y)
        assert final is not None  # top_k >= 1
        return final

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, tp_size={self.tp_size}")
