"""Tensor-parallel linear layers (vLLM names and sharding conventions).

Every parameter carries a `weight_loader(param, loaded_weight, shard_id=None)`. The loaded
weight may be a tensor or a safetensors slice (`safe_open(...).get_slice(name)`); loaders narrow
it to this rank's shard *before* materializing, so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

from typing import Any, Protocol, Union

import torch
from torch import nn

from tidal.worker.layers.gemm import PanelWeight, PackedWeight, linear, pack_if_enabled
from tidal.worker.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce


class WeightSlice(Protocol):
    """What `safetensors.safe_open(...).get_slice(name)` returns."""

    def get_shape(self) -> list[int]: ...

    def __getitem__(self, item: Any) -> torch.Tensor: ...


LoadedWeight = Union[torch.Tensor, WeightSlice]


def weight_shape(loaded: LoadedWeight) -> tuple[int, ...]:
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_weight(loaded: LoadedWeight, dim: int, start: int, size: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start+size) of a tensor or safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, size)
    if dim == 0:
        return loaded[start : start + size]
    if dim == 1:
        return loaded[:, start : start + size]
    raise ValueError(f"can only narrow dim 0 or 1, got {dim}")


def load_full(loaded: LoadedWeight) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: shard shape {tuple(src.shape)} != parameter shape {tuple(dst.shape)}")
    dst.copy_(src)  # converts dtype and crosses devices (checkpoint on CPU, param maybe on GPU)


def check_dim(loaded: LoadedWeight, dim: int, expected: int, what: str) -> None:
    """A checkpoint tensor must have the full (unsharded) size the config implies; narrowing a
    wrong-sized tensor could otherwise succeed silently."""
    actual = weight_shape(loaded)[dim]
    if actual != expected:
        raise ValueError(f"{what}: checkpoint tensor has size {actual} on dim {dim}, expected {expected}")


def default_weight_loader(param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
    """Replicated parameter: every rank keeps the whole tensor."""
    copy_checked(param.data, load_full(loaded), "replicated weight")


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{numerator} is not divisible by tensor_parallel_size {denominator}")
    return numerator // denominator


class LinearBase(nn.Module):
    """Parameters are made in torch's default dtype and device, which the loader sets."""

    def __init__(self, input_size: int, output_size: int, bias: bool) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.has_bias = bias
        self.packed_weight: PackedWeight | PanelWeight | None = None

    def _make_params(self, out_features: int, in_features: int, bias: bool) -> None:
        # torch.empty: the loader (or dummy init) fills every element.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader  # type: ignore[attr-defined]
        else:
            self.register_parameter("bias", None)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        raise NotImplementedError

    def process_weights_after_loading(self) -> None:
        """Called once all weights are loaded: move the weight into the fastest GEMM's layout.
        The dense Parameter is dropped (set to None) when packed, so weights are held once."""
        if self.packed_weight is None:
            self.packed_weight = pack_if_enabled(self.weight)
            if self.packed_weight is not None:
                self.weight = None  # type: ignore[assignment]

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W^T (+ bias) on this rank's shard."""
        return linear(x, self.weight, self.packed_weight, bias)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.has_bias}, tp_size={self.tp_size}"


class ColumnParallelLinear(LinearBase):
    """Y = X A^T with A's output rows split across ranks; each rank yields its slice of Y."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self._make_params(self.output_size_per_partition, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        check_dim(loaded, 0, self.output_size, type(self).__name__)
        size = param.shape[0]
        shard = narrow_weight(loaded, 0, self.tp_rank * size, size)
        copy_checked(param.data, shard, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one matmul (gate_up_proj: shards 0=gate, 1=up).

    Each rank holds [gate_shard; up_shard], so SiluAndMul splits the local output in halves.
    """

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        self.output_sizes = list(output_sizes)
        super().__init__(input_size, sum(output_sizes), bias)
        for size in output_sizes:
            divide(size, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id is None:  # checkpoint already stores the fused tensor: load part by part
            check_dim(loaded, 0, self.output_size, type(self).__name__)
            offset = 0
            for i, size in enumerate(self.output_sizes):
                self.weight_loader(param, _Rows(loaded, offset, size), i)
                offset += size
            return
        check_dim(loaded, 0, self.output_sizes[shard_id], f"{type(self).__name__}[{shard_id}]")
        shard_size = self.output_sizes[shard_id] // self.tp_size
        local_offset = sum(self.output_sizes[:shard_id]) // self.tp_size
        shard = narrow_weight(loaded, 0, self.tp_rank * shard_size, shard_size)
        copy_checked(param.data.narrow(0, local_offset, shard_size), shard, f"{type(self).__name__}[{shard_id}]")


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection split by heads (shard ids "q", "k", "v").

    When num_kv_heads < tp_size the KV heads are replicated: rank r holds the single kv head
    r * total_num_kv_heads // tp_size, which is the kv head its query heads belong to.
    """

    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int,
                 total_num_kv_heads: int | None = None, bias: bool = False) -> None:
        tp_size = get_tp_size()
        total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = divide(total_num_heads, tp_size)
        if tp_size >= total_num_kv_heads:
            divide(tp_size, total_num_kv_heads)
            self.num_kv_heads = 1
        else:
            self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * head_size
        super().__init__(hidden_size, output_size, bias)

    def _shard_layout(self, shard_id: str) -> tuple[int, int, int]:
        """(offset in local param, size, start in the checkpoint tensor) for one of q/k/v."""
        q_size = self.num_heads * self.head_size
        kv_size = self.num_kv_heads * self.head_size
        if shard_id == "q":
            return 0, q_size, self.tp_rank * q_size
        kv_head = self.tp_rank * self.total_num_kv_heads // self.tp_size
        start = kv_head * self.head_size  # == tp_rank * kv_size when kv heads are not replicated
        if shard_id == "k":
            return q_size, kv_size, start
        if shard_id == "v":
            return q_size + kv_size, kv_size, start
        raise ValueError(f"unknown qkv shard id {shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if shard_id is None:  # fused qkv checkpoint tensor
            q_total = self.total_num_heads * self.head_size
            kv_total = self.total_num_kv_heads * self.head_size
            check_dim(loaded, 0, q_total + 2 * kv_total, type(self).__name__)
            for sid, offset, size in (("q", 0, q_total), ("k", q_total, kv_total), ("v", q_total + kv_total, kv_total)):
                self.weight_loader(param, _Rows(loaded, offset, size), sid)
            return
        total_heads = self.total_num_heads if shard_id == "q" else self.total_num_kv_heads
        check_dim(loaded, 0, total_heads * self.head_size, f"{type(self).__name__}[{shard_id}]")
        offset, size, start = self._shard_layout(shard_id)
        shard = narrow_weight(loaded, 0, start, size)
        copy_checked(param.data.narrow(0, offset, size), shard, f"{type(self).__name__}[{shard_id}]")


class RowParallelLinear(LinearBase):
    """Y = X A^T with A's input columns split across ranks; partial sums are all-reduced."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self._make_params(output_size, self.input_size_per_partition, bias)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias is replicated: added once after the reduce
            default_weight_loader(param, loaded)
            return
        check_dim(loaded, 1, self.input_size, type(self).__name__)
        size = param.shape[1]
        shard = narrow_weight(loaded, 1, self.tp_rank * size, size)
        copy_checked(param.data, shard, type(self).__name__)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: this rank's slice of the input columns (a column-parallel layer's output)."""
        if self.tp_size == 1:
            return self.matmul(x, self.bias)
        y = tensor_model_parallel_all_reduce(self.matmul(x, None))
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(LinearBase):
    """Y = X A^T with the whole weight on every rank (e.g. an MoE router: every rank routes)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__(input_size, output_size, bias)
        self._make_params(output_size, input_size, bias)

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class _Rows:
    """Rows [offset, offset+length) of a loaded weight, itself sliceable like a safetensors slice,
    so fused checkpoints reuse the per-shard loaders without materializing the fused tensor."""

    def __init__(self, loaded: LoadedWeight, offset: int, length: int) -> None:
        self.loaded = loaded
        self.offset = offset
        self.length = length

    def get_shape(self) -> list[int]:
        return [self.length, *weight_shape(self.loaded)[1:]]

    def __getitem__(self, item: Any) -> torch.Tensor:
        if not isinstance(item, slice) or item.step not in (None, 1):
            raise TypeError("_Rows supports contiguous row slices only")
        start, stop, _ = item.indices(self.length)
        return narrow_weight(self.loaded, 0, self.offset + start, stop - start)
