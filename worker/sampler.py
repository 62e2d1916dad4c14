"""Batched sampler: penalties, min_tokens, temperature, min-p/top-k/top-p, seeded draws, logprobs.

Semantics follow vLLM V1. Two choices shape the code:

* Determinism (DESIGN.md): a row's draw is a pure function of (seed, position) and its own
  logits. We use the exponential race (`argmax(w / E)`, E ~ Exp(1) from a counter-based hash
  of (seed, position, index)), never a torch.Generator. Hashing all [B, V] entries is too slow
  on CPU, so the race runs in two levels: the vocab is cut into fixed blocks of `block_size`;
  a race among block sums picks a block, then a race among that block's tokens picks the
  token. min of independent exponentials is again exponential, so this is exactly
  P(token) = w_t / sum(w), and the work is one [B, V] block-sum plus [B, V/bs + bs] hashes.
* CPU speed: fresh [B, V] tensors cost page faults and bool-mask ops are slow on CPU, so the
  random path works in place on one float32 copy, in *weight space* w = exp(x - max) in
  (0, 1]. Every truncation reduces to a per-row cutoff omega (drop w < omega); applying it is
  `w /= omega; threshold_(w, 1-2^-24, 0)`, two in-place passes (the race is scale-invariant).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tidal.protocol.messages import LogprobsArrays
from tidal.protocol.sampling_params import SamplingParams

_GREEDY_EPS = 1e-5  # same threshold as SamplingParams.sampling_type_greedy
# Weights below 2^-100 of the row max are dropped: the per-row rescale by 1/omega then stays
# < 2^100, so float32 block sums over 152k entries cannot overflow.
_WEIGHT_FLOOR = 2.0**-100
_BELOW_ONE = 1.0 - 2.0**-24  # largest float32 < 1: `w > _BELOW_ONE` is exactly `w >= 1`


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >= 1 << 63 else c


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_SALT_BLOCK = _i64(0xD1B54A32D192ED03)  # separates the block-level stream from the token one
_SALT_TOKEN = 0


def _mix64(z: torch.Tensor) -> torch.Tensor:
    """splitmix64 finalizer on int64 (wrapping multiply). torch's >> is arithmetic on int64,
    so each shift is masked to make it the logical shift the algorithm needs."""
    z = z ^ ((z >> 30) & ((1 << 34) - 1))
    z = z * _MIX1
    z = z ^ ((z >> 27) & ((1 << 37) - 1))
    z = z * _MIX2
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def row_keys(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B] int64 key of each row's draw: depends on (seed, position) only."""
    return _mix64(_mix64(seeds) + (positions + 1) * _GOLDEN)


def _exponentials(keys: torch.Tensor, index: torch.Tensor, salt: int) -> torch.Tensor:
    """Exp(1) variates [R, n] (float64) for `index` ([n] or [R, n]) under each row key."""
    h = _mix64(keys[:, None] + (index * _GOLDEN + salt))
    # 52 random bits + 0.5 -> u strictly inside (0, 1), so -log(u) is finite and > 0.
    u = ((h >> 12) & ((1 << 52) - 1)).to(torch.float64).add_(0.5).mul_(2.0**-52)
    return u.log_().neg_()


@dataclass
class SamplingMetadata:
    """One row per request that samples this step (built by the model runner)."""

    temperature: torch.Tensor  # [B] float32; rows with temperature < 1e-5 are greedy
    all_greedy: bool
    all_random: bool
    top_k: torch.Tensor | None  # [B] int64, 0 = off (None when no row uses it)
    top_p: torch.Tensor | None  # [B] float32, 1.0 = off
    min_p: torch.Tensor | None  # [B] float32, 0.0 = off
    seeds: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: sequence index of the token being sampled
    no_penalties: bool
    presence_penalties: torch.Tensor | None  # [B] float32
    frequency_penalties: torch.Tensor | None  # [B] float32
    repetition_penalties: torch.Tensor | None  # [B] float32
    prompt_token_ids: torch.Tensor | None  # [B, Lmax] int64 padded with vocab_size
    output_token_ids: list[list[int]]  # per row, tokens generated so far
    min_tokens: dict[int, set[int]] = field(default_factory=dict)  # row -> ids forbidden now
    max_num_logprobs: int | None = None  # max k over rows; None when no row wants logprobs

    @staticmethod
    def build(
        params: list[SamplingParams],
        prompt_token_ids: list[list[int]],
        output_token_ids: list[list[int]],
        positions: list[int],
        eos_token_ids: list[int | None],
        vocab_size: int,
        device: torch.device | str = "cpu",
    ) -> SamplingMetadata:
        greedy = [p.temperature < _GREEDY_EPS for p in params]

        def opt(values: list[float] | list[int], off: float, dtype: torch.dtype) -> torch.Tensor | None:
            # Skip the tensor (and the sampler's work) when no row uses the knob.
            if all(v == off for v in values):
                return None
            return torch.tensor(values, dtype=dtype, device=device)

        # Truncation cannot change an argmax, so greedy rows count as "off" whatever they carry.
        top_k = opt([0 if g else p.top_k for p, g in zip(params, greedy)], 0, torch.int64)
        top_p = opt([1.0 if g else p.top_p for p, g in zip(params, greedy)], 1.0, torch.float32)
        min_p = opt([0.0 if g else p.min_p for p, g in zip(params, greedy)], 0.0, torch.float32)
        pres = opt([p.presence_penalty for p in params], 0.0, torch.float32)
        freq = opt([p.frequency_penalty for p in params], 0.0, torch.float32)
        rep = opt([p.repetition_penalty for p in params], 1.0, torch.float32)
        prompts = None
        if rep is not None:
            width = max(len(t) for t in prompt_token_ids)
            padded = [t + [vocab_size] * (width - len(t)) for t in prompt_token_ids]
            prompts = torch.tensor(padded, dtype=torch.int64, device=device)
        # The front-end always sets a seed; a missing one still samples, just not reproducibly.
        seeds = [_i64(p.seed if p.seed is not None else random.getrandbits(64)) for p in params]
        min_tokens: dict[int, set[int]] = {}
        for i, p in enumerate(params):
            if len(output_token_ids[i]) < p.min_tokens:
                # Like vLLM, eos is blocked even with ignore_eos (it is in all_stop_token_ids).
                ids = set(p.stop_token_ids or [])
                if eos_token_ids[i] is not None:
                    ids.add(eos_token_ids[i])  # type: ignore[arg-type]
                ids = {t for t in ids if t < vocab_size}
                if ids:
                    min_tokens[i] = ids
        ks = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            seeds=torch.tensor(seeds, dtype=torch.int64, device=device),
            positions=torch.tensor(positions, dtype=torch.int64, device=device),
            no_penalties=pres is None and freq is None and rep is None,
            presence_penalties=pres,
            frequency_penalties=freq,
            repetition_penalties=rep,
            prompt_token_ids=prompts,
            output_token_ids=output_token_ids,
            min_tokens=min_tokens,
            max_num_logprobs=max(ks) if ks else None,
        )


@dataclass
class LogprobsTensors:
    """Column 0 = the chosen (sampled or prompt) token, columns 1..k = top-k by logprob.

    Rows share one k (the batch max); a row that asked for fewer keeps only its first k+1
    columns: `slice(rows, num_logprobs=k)` or `[:, :k+1]` on the arrays."""

    token_ids: torch.Tensor  # [N, k+1] int32
    logprobs: torch.Tensor  # [N, k+1] float32
    ranks: torch.Tensor  # [N] int32: 1 + number of vocab entries with strictly greater logprob

    def slice(self, rows: slice | list[int] | torch.Tensor | int, num_logprobs: int | None = None) -> LogprobsTensors:
        if isinstance(rows, int):
            rows = slice(rows, rows + 1)  # keep the row dimension
        cols = slice(None) if num_logprobs is None else slice(0, num_logprobs + 1)
        return LogprobsTensors(self.token_ids[rows][:, cols], self.logprobs[rows][:, cols], self.ranks[rows])

    def to_arrays(self) -> LogprobsArrays:
        return LogprobsArrays(
            token_ids=np.ascontiguousarray(self.token_ids.cpu().numpy(), dtype=np.int32),
            logprobs=np.ascontiguousarray(self.logprobs.cpu().numpy(), dtype=np.float32),
            ranks=np.ascontiguousarray(self.ranks.cpu().numpy(), dtype=np.int32),
        )


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


def _block_reduce(x: torch.Tensor, bs: int, op: str) -> torch.Tensor:
    """[R, V] -> [R, ceil(V / bs)]: `op` ("sum" or "amax") over consecutive blocks of bs entries,
    the last block possibly short. Reductions over a contiguous inner dim are fast on CPU."""
    R, V = x.shape
    nf = V // bs
    parts = []
    if nf:
        parts.append(getattr(x[:, : nf * bs].view(R, nf, bs), op)(-1))
    if V > nf * bs:
        parts.append(getattr(x[:, nf * bs :], op)(-1, keepdim=True))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def _block_gather(x: torch.Tensor, blocks: torch.Tensor, bs: int, fill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Entries of the chosen blocks [R, n] -> (values, token ids) [R, n * bs]; ids past the
    vocab (short last block) read as `fill`."""
    V = x.shape[1]
    idx = (blocks[:, :, None] * bs + torch.arange(bs, device=x.device)).flatten(1)
    vals = x.gather(1, idx.clamp(max=V - 1))
    if V % bs:
        vals = vals.masked_fill(idx >= V, fill)
    return vals, idx


_PREFILTER_BLOCK = 64
_PROMPT_CHUNK_ELEMS = 1 << 25


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """argmax(-1) (first maximal index, like torch's), ~8x faster on CPU: torch's argmax is a
    scalar loop, amax is vectorised, so find the first block holding the max, then look inside."""
    bs = _PREFILTER_BLOCK
    if x.shape[1] <= 4 * bs:
        return x.argmax(-1)
    blk = _block_reduce(x, bs, "amax").argmax(-1, keepdim=True)
    vals, idx = _block_gather(x, blk, bs, float("-inf"))
    return idx.gather(1, vals.argmax(-1, keepdim=True)).squeeze(1)


def _topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk(x, k, -1) (sorted), prefiltered by blocks: the k largest entries all lie in
    the k blocks with the largest maxima (each such block holds an entry >= the k-th largest),
    so topk runs over k * 64 entries instead of V. Values are exact; tie order may differ."""
    bs = _PREFILTER_BLOCK
    if 4 * k * bs > x.shape[1]:
        return x.topk(k, dim=-1)
    blocks = _block_reduce(x, bs, "amax").topk(k, dim=-1, sorted=False).indices
    vals, idx = _block_gather(x, blocks, bs, float("-inf"))
    top, pos = vals.topk(k, dim=-1)
    return top, idx.gather(1, pos)


def _logprobs_of(logits: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsTensors:
    lp = torch.log_softmax(logits.to(torch.float32), dim=-1)  # raw: before any processing
    chosen_lp = lp.gather(1, chosen[:, None])
    ids, lps = chosen[:, None], chosen_lp
    if k > 0:
        top_lp, top_ids = _topk(lp, min(k, lp.shape[1]))
        ids, lps = torch.cat([ids, top_ids], 1), torch.cat([lps, top_lp], 1)
    # rank = 1 + #(lp > chosen): strictly greater, so tied tokens share a rank. Counted in place
    # as sum(clamp(sign(lp - chosen), 0)): bool masks and their sums are slow on CPU.
    ranks = lp.sub_(chosen_lp).sign_().clamp_(min=0).sum(-1).to(torch.int32) + 1
    return LogprobsTensors(ids.to(torch.int32), lps, ranks)


def compute_prompt_logprobs(logits: torch.Tensor, target_token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Raw logprobs of the prompt's next tokens: row i scores target_token_ids[i]."""
    # Chunk rows so the float32 log-softmax copy stays ~128 MiB for long prompts.
    step = max(1, _PROMPT_CHUNK_ELEMS // max(1, logits.shape[1]))
    parts = [
        _logprobs_of(logits[i : i + step], target_token_ids[i : i + step].long(), k)
        for i in range(0, logits.shape[0], step)
    ]
    if len(parts) == 1:
        return parts[0]
    return LogprobsTensors(*(torch.cat(t) for t in zip(*((p.token_ids, p.logprobs, p.ranks) for p in parts))))


def _take(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t.index_select(0, rows)


class Sampler(nn.Module):
    """`forward(logits [B, V], md) -> SamplerOutput`. Never modifies `logits`."""

    def __init__(self, block_size: int = 1024, top_p_candidates: int = 64) -> None:
        super().__init__()
        self.block_size = block_size  # part of the draw's definition: changing it changes tokens
        self.top_p_candidates = top_p_candidates  # top-p looks here first, then 4x wider, ...
        # Reused [B, V] work buffer: a fresh one per step costs page faults (~10 ms at B=256).
        self._scratch: torch.Tensor | None = None

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        if md.all_greedy and md.no_penalties and not md.min_tokens:
            tokens = _argmax(logits)  # nothing to process: no copy
        else:
            x = self._work_copy(logits)  # logprobs below need the raw logits
            self.apply_penalties(x, md)
            tokens = self._sample(x, md)
        lp = None
        if md.max_num_logprobs is not None:
            lp = _logprobs_of(logits, tokens, md.max_num_logprobs)
        return SamplerOutput(tokens, lp)

    def _work_copy(self, logits: torch.Tensor) -> torch.Tensor:
        n = logits.numel()
        buf = self._scratch
        if buf is None or buf.numel() < n or buf.device != logits.device:
            buf = self._scratch = torch.empty(n, dtype=torch.float32, device=logits.device)
        return buf[:n].view(logits.shape).copy_(logits)

    # ------------------------------------------------------------------ processors

    @staticmethod
    def apply_penalties(x: torch.Tensor, md: SamplingMetadata) -> None:
        """min_tokens, repetition, frequency and presence penalties, in place on x [B, V]."""
        B, V = x.shape
        if md.min_tokens:
            rows = [r for r, ids in md.min_tokens.items() for _ in ids]
            cols = [t for ids in md.min_tokens.values() for t in ids]
            x[torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device)] = float("-inf")
        if md.no_penalties:
            return
        # Penalties touch only tokens seen in the prompt/output, so gather those entries, edit
        # them, and scatter back, instead of several passes over [B, V].
        parts: list[torch.Tensor] = []
        counts = None
        width = max((len(o) for o in md.output_token_ids), default=0)
        if width and (md.frequency_penalties is not None or md.presence_penalties is not None
                      or md.repetition_penalties is not None):
            out = torch.tensor([o + [V] * (width - len(o)) for o in md.output_token_ids],
                               dtype=torch.int64, device=x.device)
            # Column V absorbs the padding.
            counts = torch.zeros(B, V + 1, dtype=torch.int32, device=x.device)
            counts.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32))
            parts.append(out)
        rep = md.repetition_penalties
        if rep is not None and md.prompt_token_ids is not None:
            parts.append(md.prompt_token_ids.to(x.device))
        if not parts:
            return
        idx = torch.cat(parts, 1)
        present = None
        if rep is not None:
            present = torch.zeros(B, V + 1, dtype=torch.bool, device=x.device).scatter_(1, idx, True)
        # Padding points at token 0. Every entry's new value is a function of the token alone
        # (its logit, count, presence), so duplicate writes to one token agree.
        idx = idx.masked_fill(idx >= V, 0)
        g = x.gather(1, idx)
        if present is not None and rep is not None:
            r = rep.to(x.device, x.dtype)[:, None]
            g = torch.where(present.gather(1, idx), torch.where(g > 0, g / r, g * r), g)
        if counts is not None:
            c = counts.gather(1, idx).to(x.dtype)
            if md.frequency_penalties is not None:
                g = g - md.frequency_penalties[:, None] * c
            if md.presence_penalties is not None:
                g = g - md.presence_penalties[:, None] * (c > 0).to(x.dtype)
        x.scatter_(1, idx, g)

    def random_weights(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
        """Turns x [R, V] (random rows, penalties applied) IN PLACE into unnormalised sampling
        weights: temperature, then min-p, top-k, top-p (each on what the previous kept)."""
        R, V = x.shape
        x.div_(temperature[:, None])
        w = x.sub_(x.amax(-1, keepdim=True)).exp_()  # w in [0, 1]; the row max is exactly 1
        omega = torch.full((R,), _WEIGHT_FLOOR, dtype=x.dtype, device=x.device)
        if min_p is not None:  # vLLM: drop p < min_p * p_max, i.e. w < min_p
            omega = torch.maximum(omega, min_p.to(x.dtype))
        if top_k is not None or top_p is not None:
            k = top_k.clamp(max=V) if top_k is not None else None
            width = int(k.max()) if k is not None else 0
            if top_p is not None:
                width = max(width, self.top_p_candidates)
            vals = _topk(w, min(max(width, 1), V))[0]  # sorted descending
            has_k = k > 0 if k is not None else torch.zeros(R, dtype=torch.bool, device=x.device)
            if k is not None:  # keep ties with the k-th value, like vLLM
                kth = vals.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
                omega = torch.where(has_k, torch.maximum(omega, kth), omega)
            if top_p is not None:
                omega = torch.maximum(omega, self._top_p_cutoff(w, vals, omega, top_p, has_k, min_p))
        w.div_(omega[:, None])
        return F.threshold_(w, _BELOW_ONE, 0.0)

    def _top_p_cutoff(self, w: torch.Tensor, vals: torch.Tensor, omega: torch.Tensor, top_p: torch.Tensor,
                      has_k: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
        """Per-row weight cutoff keeping the smallest prefix (by weight) whose mass, within what
        min-p/top-k kept, reaches top_p. Prefix sums are sequential, so a row's cutoff does not
        depend on how many candidate columns the batch asked for."""
        R, K = vals.shape
        active = top_p < 1.0
        kept = vals >= omega[:, None]
        cand = vals.to(torch.float64) * kept
        csum = cand.cumsum(-1)
        # Mass min-p/top-k kept. top-k rows: all of it is among the candidates. Others: the
        # whole row (masked by min-p where set).
        z = w.sum(-1, dtype=torch.float32).to(torch.float64)
        if min_p is not None:
            rows = ((min_p > 0) & ~has_k & active).nonzero().squeeze(1)
            if rows.numel():
                wm = w.index_select(0, rows)
                z[rows] = torch.where(wm >= min_p[rows, None], wm, 0.0).sum(-1).to(torch.float64)
        n_kept = kept.sum(-1).clamp(min=1)
        z = torch.where(has_k, csum.gather(1, (n_kept - 1)[:, None]).squeeze(1), z)
        excl = torch.cat([torch.zeros_like(csum[:, :1]), csum[:, :-1]], 1) / z[:, None]
        keep = (excl < top_p[:, None].to(torch.float64)) & kept
        n = keep.sum(-1).clamp(min=1)
        cut = vals.gather(1, (n - 1)[:, None]).squeeze(1)
        # The nucleus may run past the candidates (flat distributions): widen those rows 4x
        # (up to a full sort). Prefix sums make the answer independent of the width used.
        short = active & ~has_k & (n == K) & (csum[:, -1] / z < top_p.to(torch.float64))
        if K < w.shape[1] and bool(short.any()):
            rows = short.nonzero().squeeze(1)
            wr = w.index_select(0, rows)
            wider = _topk(wr, min(4 * K, wr.shape[1]))[0]
            cut[rows] = self._top_p_cutoff(wr, wider, omega[rows], top_p[rows], has_k[rows], _take(min_p, rows))
        return torch.where(active, cut, torch.zeros_like(cut))

    def apply_processors(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution each row samples from [B, V] (for tests and debugging): random rows
        their processed sampling distribution; greedy rows softmax of the penalised logits
        (temperature 1), whose argmax is their token."""
        x = logits.to(torch.float32, copy=True)
        self.apply_penalties(x, md)
        probs = torch.softmax(x, dim=-1)
        rows = (md.temperature >= _GREEDY_EPS).nonzero().squeeze(1)
        if rows.numel():
            w = self.random_weights(x.index_select(0, rows), md.temperature[rows], _take(md.top_k, rows),
                                    _take(md.top_p, rows), _take(md.min_p, rows))
            probs[rows] = w / w.sum(-1, keepdim=True)
        return probs

    # ------------------------------------------------------------------ sampling

    def _sample(self, x: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        if md.all_greedy:  # no weights, no hashing
            return _argmax(x)
        greedy = None if md.all_random else _argmax(x)
        rows = None if md.all_random else (md.temperature >= _GREEDY_EPS).nonzero().squeeze(1)
        xr = x if rows is None else x.index_select(0, rows)  # greedy rows skip the random path
        w = self.random_weights(xr, md.temperature if rows is None else md.temperature[rows],
                                _take(md.top_k, rows), _take(md.top_p, rows), _take(md.min_p, rows))
        tokens = self.race(w, row_keys(_take(md.seeds, rows), _take(md.positions, rows)))  # type: ignore[arg-type]
        if greedy is None:
            return tokens
        greedy[rows] = tokens
        return greedy

    def race(self, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Two-level exponential race over nonnegative weights w [R, V] -> token ids [R]."""
        blocks = _block_reduce(w, self.block_size, "sum").to(torch.float64)
        arange_nb = torch.arange(blocks.shape[1], device=w.device)
        blk = (blocks / _exponentials(keys, arange_nb, _SALT_BLOCK)).argmax(-1, keepdim=True)
        wt, tok = _block_gather(w, blk, self.block_size, 0.0)
        j = (wt.to(torch.float64) / _exponentials(keys, tok, _SALT_TOKEN)).argmax(-1, keepdim=True)
        return tok.gather(1, j).squeeze(1)
