"""Vocab-parallel embedding and LM head.

The vocabulary is split in contiguous ranges of ceil(vocab / tp_size) rows; the last ranks'
ranges may run past the true vocab and are zero-padded, so logits are gathered over the padded
size and trimmed back to the true vocab.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tidal.protocol.sizing import cdiv
from tidal.worker.layers.gemm import PanelWeight, PackedWeight, linear, pack_if_enabled
from tidal.worker.layers.linear import LoadedWeight, copy_checked, narrow_weight, weight_shape
from tidal.worker.parallel_state import (
    get_tp_rank,
    get_tp_size,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)


class VocabParallelEmbedding(nn.Module):
    # Set when the table is stored in half precision but the model computes in float32 (see
    # loader.compute_in_float32): looked-up rows are widened to it.
    output_dtype: torch.dtype | None = None

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.num_embeddings = num_embeddings  # the true vocab size
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = cdiv(num_embeddings, self.tp_size)
        self.num_embeddings_padded = self.num_embeddings_per_partition * self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = min(self.vocab_start_index + self.num_embeddings_per_partition, num_embeddings)
        # Default dtype and device: the loader sets them.
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded: LoadedWeight, shard_id: Any = None) -> None:
        rows = weight_shape(loaded)[0]
        if rows != self.num_embeddings:
            raise ValueError(f"{type(self).__name__}: checkpoint has {rows} rows, config vocab_size is {self.num_embeddings}")
        n = max(self.vocab_end_index - self.vocab_start_index, 0)
        if n > 0:
            shard = narrow_weight(loaded, 0, self.vocab_start_index, n)
            copy_checked(param.data[:n], shard, type(self).__name__)
        param.data[n:].zero_()  # padding rows: zero logits / embeddings, trimmed or masked anyway

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self._lookup(input_ids)
        # Ids outside this rank's range look up row 0 and are zeroed; the all-reduce sums the
        # single rank that owns each id.
        mask = (input_ids >= self.vocab_start_index) & (input_ids < self.vocab_end_index)
        local_ids = (input_ids - self.vocab_start_index) * mask
        out = self._lookup(local_ids)
        out.masked_fill_(~mask.unsqueeze(-1), 0)
        return tensor_model_parallel_all_reduce(out)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(ids, self.weight)
        return rows if self.output_dtype is None else rows.to(self.output_dtype)

    def extra_repr(self) -> str:
        return (
            f"num_embeddings={self.num_embeddings}, per_partition={self.num_embeddings_per_partition}, "
            f"dim={self.embedding_dim}, tp_size={self.tp_size}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-sharded output projection; `compute_logits` returns the full (true) vocab."""

    packed_weight: PackedWeight | PanelWeight | None = None
    tied: bool = False

    def tie_weights(self, embed_tokens: VocabParallelEmbedding) -> "ParallelLMHead":
        # Same partitioning as the embedding, so sharing the Parameter shares each rank's shard.
        self.weight = embed_tokens.weight
        self.tied = True
        return self

    def process_weights_after_loading(self) -> None:
        """Pack the weight for the fast CPU GEMM (see layers/gemm.py). A tied weight is packed as
        a copy, since the embedding still looks rows up in it; an untied one is dropped."""
        if self.packed_weight is None:
            self.packed_weight = pack_if_enabled(self.weight)
            if self.packed_weight is not None and not self.tied:
                self.weight = None  # type: ignore[assignment]

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden_states, self.weight, self.packed_weight)
        if self.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        if logits.shape[-1] != self.num_embeddings:
            logits = logits[..., : self.num_embeddings]
        return logits

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is not an embedding lookup; call compute_logits")
