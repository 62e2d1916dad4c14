"""Logprobs of chosen tokens (sampled, or the prompt's own) with their top-k and ranks, as vLLM
reports them: column 0 the chosen token, columns 1..k the top-k by logprob."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tidal.protocol.messages import LogprobsArrays
from tidal.worker.block_ops import topk

PROMPT_CHUNK_ELEMS = 1 << 25  # prompt logprobs: rows per chunk * V, bounds the float32 copy


@dataclass
class LogprobsTensors:
    """Column 0 = the chosen (sampled or prompt) token, columns 1..k = top-k by logprob. Rows
    share one k (the batch max); a row that asked for fewer keeps its first k+1 columns only:
    `slice(rows, num_logprobs=k)`, or `[:, :k+1]` on the arrays."""

    token_ids: torch.Tensor  # [N, k+1] int32
    logprobs: torch.Tensor  # [N, k+1] float32
    ranks: torch.Tensor  # [N] int32: 1 + number of vocab entries with strictly greater logprob

    def slice(self, rows: slice | list[int] | torch.Tensor | int, num_logprobs: int | None = None
              ) -> LogprobsTensors:
        if isinstance(rows, int):
            rows = slice(rows, rows + 1)  # keep the row dimension
        cols = slice(None) if num_logprobs is None else slice(0, num_logprobs + 1)
        return LogprobsTensors(self.token_ids[rows][:, cols], self.logprobs[rows][:, cols], self.ranks[rows])

    def to_arrays(self) -> LogprobsArrays:
        t, lp, r = (np.ascontiguousarray(v.cpu().numpy()) for v in (self.token_ids, self.logprobs, self.ranks))
        return LogprobsArrays(t.astype(np.int32, copy=False), lp.astype(np.float32, copy=False),
                              r.astype(np.int32, copy=False))


def logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, k: int, out: torch.Tensor | None = None,
                as_logits: bool = False, masked: bool = False) -> LogprobsTensors:
    """Logprobs of `logits` (or, as_logits, the logits themselves: the *_logits modes), their
    top-k and the chosen tokens' ranks; `out` [N, V] float32 is scratch (clobbered). `masked`:
    entries may be -inf (the processed modes), the chosen token's too."""
    out = torch.empty(logits.shape, dtype=torch.float32, device=logits.device) if out is None else out
    lp = out.copy_(logits) if as_logits else torch.log_softmax(logits, dim=-1, dtype=torch.float32, out=out)
    chosen_lp = lp.gather(1, chosen[:, None])
    ids, lps = chosen[:, None], chosen_lp
    if k > 0:
        top_lp, top_ids = topk(lp, min(k, lp.shape[1]))
        ids, lps = torch.cat([ids, top_ids], 1), torch.cat([lps, top_lp], 1)
    # rank = 1 + #(lp > chosen): strictly greater, so tied tokens share a rank. Counted in place
    # as sum(clamp(sign(lp - chosen), 0)): bool masks and their sums are slow on CPU.
    # Masked (-inf) entries count as lower; -inf - -inf (a masked chosen token) is NaN, counted as
    # 0 (raw logits are finite: that full-vocabulary pass only where masks can be).
    signs = lp.sub_(chosen_lp).sign_().clamp_(min=0)
    ranks = (signs.nan_to_num_(0.0) if masked else signs).sum(-1).to(torch.int32) + 1
    return LogprobsTensors(ids.to(torch.int32), lps, ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Raw logprobs of the prompt's next tokens: row i scores target_token_ids[i]."""
    step = max(1, PROMPT_CHUNK_ELEMS // max(1, logits.shape[1]))
    parts = [logprobs_of(logits[i : i + step], target_token_ids[i : i + step].long(), k)
             for i in range(0, logits.shape[0], step)]
    return parts[0] if len(parts) == 1 else LogprobsTensors(
        *(torch.cat(t) for t in zip(*((p.token_ids, p.logprobs, p.ranks) for p in parts))))
