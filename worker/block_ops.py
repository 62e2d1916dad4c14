"""Block prefilters over the rows of [B, V] logits: torch's argmax is a scalar loop on CPU and
its top-k sorts too much; reductions over fixed blocks of consecutive entries are vectorised,
so the argmax / top-k first find the blocks that can hold the answer, then look inside."""
from __future__ import annotations

import torch

PREFILTER_BLOCK = 64  # block size of the argmax / top-k prefilters


def block_reduce(x: torch.Tensor, bs: int, op: str) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / bs)]: `op` ("sum" or "amax") over consecutive blocks of bs entries,
    the last block possibly short. Reductions over a contiguous inner dim are fast on CPU."""
    R, V = x.shape
    nf = V // bs
    parts = [getattr(x[:, : nf * bs].reshape(R, nf, bs), op)(-1)] if nf else []  # reshape: a view here
    if V > nf * bs:
        parts.append(getattr(x[:, nf * bs :], op)(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def block_gather(x: torch.Tensor, blocks: torch.Tensor, bs: int, fill: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries of the chosen blocks [R, n] -> (values, token ids) [R, n * bs]; ids past the
    vocab (short last block) read as `fill`."""
    V = x.shape[1]
    idx = (blocks[:, :, None] * bs + torch.arange(min(bs, V), device=x.device)).flatten(1)
    vals = x.gather(1, idx.clamp(max=V - 1))
    if V % bs:
        vals = vals.masked_fill(idx >= V, fill)
    return vals, idx


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1) of [B, V] (the first maximal index, so greedy tokens of logits), ~8x faster
    on CPU: torch's argmax is a scalar loop, amax is vectorised, so find the first block holding
    the max, then look inside."""
    bs = PREFILTER_BLOCK
    if x.shape[1] <= 4 * bs:
        return x.argmax(-1)
    blk = block_reduce(x, bs, "amax").argmax(-1, keepdim=True)
    vals, idx = block_gather(x, blk, bs, float("-inf"))
    return idx.gather(1, vals.argmax(-1, keepdim=True)).squeeze(1)


def topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, -1) (sorted), prefiltered by blocks: the k largest entries all lie in
    the k blocks with the largest maxima (each such block holds an entry >= the k-th largest),
    so topk runs over k * 64 entries instead of V. Values are exact; tie order may differ."""
    bs = PREFILTER_BLOCK
    if 4 * k * bs > x.shape[1]:
        return x.topk(k, dim=-1)
    blocks = block_reduce(x, bs, "amax").topk(k, dim=-1, sorted=False).indices
    vals, idx = block_gather(x, blocks, bs, float("-inf"))
    top, pos = vals.topk(k, dim=-1)
    return top, idx.gather(1, pos)
