"""Batched sampler (vLLM V1 semantics): allowed tokens, bad words, logit bias (logits_processors),
min_tokens, penalties, temperature, min-p/top-k/top-p, seeded draws, logprobs in each logprobs_mode
(worker/logprobs.py). A row whose masks leave no token samples NO_TOKEN (its request fails).

* Determinism (DESIGN.md): a draw is a pure function of (seed, position) and the row's own
  logits: an exponential race `argmax(w / E)` with E ~ Exp(1) from a counter-based hash of
  (seed, position, index), never a torch.Generator. Hashing all [B, V] entries is too slow on
  CPU, so the race has two levels: among sums of fixed `block_size` vocab blocks, then among
  the chosen block's tokens. A min of independent exponentials is exponential, so this is
  exactly P(t) = w_t / sum(w), for one [B, V] block-sum plus [B, V/bs + bs] hashes.
* CPU speed: fresh [B, V] tensors cost page faults and bool masks are slow, so the random path
  works in place on one float32 buffer in weight space w = exp(x - max) in (0, 1]. Every
  truncation becomes a per-row cutoff omega (drop w < omega), applied by two in-place passes
  `w /= omega; threshold_(w, 1 - 2^-24, 0)` (the race does not care about a row's scale).
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tidal.protocol.request_rules import num_logprobs
from tidal.protocol.sampling_params import SamplingParams
from tidal.protocol.sampling_params import GREEDY_EPS
from tidal.worker.block_ops import argmax, block_gather as _block_gather, block_reduce as _block_reduce, topk as _topk
from tidal.worker.logits_processors import (NO_TOKEN, WEIGHT_FLOOR, Cutoffs, TokenRules, apply_penalties,
                                            argmax_is_masked, device_tensor, maskable_rows, processed_logits,
                                            rows_fully_masked)
from tidal.worker.logprobs import LogprobsTensors, compute_prompt_logprobs, logprobs_of

__all__ = ["NO_TOKEN", "LogprobsTensors", "Sampler", "SamplerOutput", "SamplingMetadata", "argmax",
           "compute_prompt_logprobs", "row_keys"]

# Weights below WEIGHT_FLOOR (2^-100) of the row max are dropped (every row, so a draw never depends on its
# batch): the per-row rescale by 1/omega then stays < 2^100 and float32 block sums cannot overflow.
_BELOW_ONE = 1.0 - 2.0**-24  # largest float32 < 1: `w > _BELOW_ONE` is exactly `w >= 1`
_LOG2E = 1.4426950408889634
# Hotter temperatures sample as this one: in float32 every allowed token's weight is already 1
# (uniform), while 1 / T stays a normal number, so masked tokens (-inf logits) keep weight 0.
# A temperature past float32's range (1e308 is a valid request) made that product NaN.
MAX_TEMPERATURE = 1e30


def _i64(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no uint64 arithmetic)."""
    return (c + (1 << 63)) % (1 << 64) - (1 << 63)


_GOLDEN = _i64(0x9E3779B97F4A7C15)
_MIX1 = _i64(0xBF58476D1CE4E5B9)
_MIX2 = _i64(0x94D049BB133111EB)
_SALT_BLOCK = _i64(0xD1B54A32D192ED03)  # separates the block-level stream from the token one (salt 0)


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

    temperature: torch.Tensor  # [B] float32; rows < GREEDY_EPS are greedy (build() writes exactly 0)
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
    max_num_logprobs: int | None = None  # max k over rows (-1 counted as V); None when no row wants logprobs
    token_rules: TokenRules | None = None  # allowed_token_ids, bad words, logit_bias (None: no row uses them)
    logprobs_mode: str = "raw_logprobs"  # the engine's: raw_/processed_ logprobs/logits
    # Known on the host when the metadata is built, so the sampler never reads them back from
    # the device (a host sync per step on a GPU): the largest top_k (0 = none), and the indices
    # of the random rows when greedy and random rows are mixed (None otherwise).
    max_top_k: int = 0
    random_rows: torch.Tensor | None = None
    # [R] int64, the rows whose masks may leave no token (logits_processors.maskable_rows; None:
    # none may): the sampler checks them, and a row left with nothing samples NO_TOKEN.
    maskable_rows: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """No row's logits change before temperature: greedy rows are their argmax."""
        return self.no_penalties and not self.min_tokens and self.token_rules is None

    @staticmethod
    def build(params: list[SamplingParams], prompt_token_ids: list[list[int]], output_token_ids: list[list[int]],
              positions: list[int], eos_token_ids: list[int | None], vocab_size: int,
              device: torch.device | str = "cpu", logprobs_mode: str = "raw_logprobs",
              grammar_rows: Sequence[int] = ()) -> SamplingMetadata:
        """From per-row inputs; knobs no row uses get no tensor (and cost the sampler nothing).
        `grammar_rows`: the rows whose logits a structured-output bitmask masked."""
        greedy = [p.sampling_type_greedy for p in params]

        def opt(values: list[float] | list[int], off: float, dtype: torch.dtype) -> torch.Tensor | None:
            return None if all(v == off for v in values) else device_tensor(values, dtype, device)

        # Truncation cannot change an argmax, so greedy rows count as "off" whatever they carry.
        top_ks = [0 if g else p.top_k for p, g in zip(params, greedy)]
        top_k = opt(top_ks, 0, torch.int64)
        top_p = opt([1.0 if g else p.top_p for p, g in zip(params, greedy)], 1.0, torch.float32)
        min_p = opt([0.0 if g else p.min_p for p, g in zip(params, greedy)], 0.0, torch.float32)
        pres = opt([p.presence_penalty for p in params], 0.0, torch.float32)
        freq = opt([p.frequency_penalty for p in params], 0.0, torch.float32)
        rep = opt([p.repetition_penalty for p in params], 1.0, torch.float32)
        prompts = None
        if rep is not None:
            width = max(len(t) for t in prompt_token_ids)
            padded = [t + [vocab_size] * (width - len(t)) for t in prompt_token_ids]
            prompts = device_tensor(padded, torch.int64, device)
        # The front-end always sets a seed; a missing one still samples, just not reproducibly.
        seeds = [_i64(p.seed if p.seed is not None else random.getrandbits(64)) for p in params]
        # Like vLLM, min_tokens blocks eos even with ignore_eos (it is in all_stop_token_ids).
        stops = [{t for t in [*(p.stop_token_ids or []), *([] if e is None else [e])] if t < vocab_size}
                 for p, e in zip(params, eos_token_ids)]
        min_tokens = {i: stops[i] for i, p in enumerate(params)
                      if len(output_token_ids[i]) < p.min_tokens and stops[i]}
        ks = [num_logprobs(p.logprobs, vocab_size) for p in params if p.logprobs is not None]
        mixed = any(greedy) and not all(greedy)
        random_rows = [i for i, g in enumerate(greedy) if not g] if mixed else None
        maskable = maskable_rows(params, min_tokens, grammar_rows, vocab_size)
        return SamplingMetadata(
            temperature=device_tensor([0.0 if g else min(p.temperature, MAX_TEMPERATURE)
                                       for p, g in zip(params, greedy)],
                                      torch.float32, device),
            all_greedy=all(greedy), all_random=not any(greedy), top_k=top_k, top_p=top_p, min_p=min_p,
            seeds=device_tensor(seeds, torch.int64, device),
            positions=device_tensor(positions, torch.int64, device),
            no_penalties=pres is None and freq is None and rep is None,
            presence_penalties=pres, frequency_penalties=freq, repetition_penalties=rep,
            prompt_token_ids=prompts, output_token_ids=output_token_ids, min_tokens=min_tokens,
            max_num_logprobs=max(ks) if ks else None,
            token_rules=TokenRules.build(params, output_token_ids, device), logprobs_mode=logprobs_mode,
            max_top_k=0 if top_k is None else max(top_ks),
            random_rows=None if random_rows is None else device_tensor(random_rows, torch.long, device),
            maskable_rows=device_tensor(maskable, torch.int64, device) if maskable else None)


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [B] int64; NO_TOKEN in a row whose masks left no token
    logprobs: LogprobsTensors | None


def _take(t: torch.Tensor | None, rows: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or rows is None else t.index_select(0, rows)


class Sampler(nn.Module):
    """`forward(logits [B, V], md) -> SamplerOutput`. Never modifies `logits`."""

    def __init__(self, block_size: int = 1024, top_p_candidates: int = 64, sync_free: bool | None = None) -> None:
        super().__init__()
        self.block_size = block_size  # part of the draw's definition: changing it changes tokens
        self.top_p_candidates = top_p_candidates  # top-p looks here first, then 4x wider, ...
        # Truncation without asking the device anything (no host sync: a full sort for top-p,
        # masks instead of nonzero for min-p); None: so off the CPU, where syncs stall the
        # stream and sorts are cheap. Same results either way (tests run both on CPU).
        self.sync_free = sync_free
        # Reused [B, V] buffers: a fresh 155 MB tensor per step (B=256) costs ~50 ms of page faults.
        self._bufs: dict[str, torch.Tensor] = {}

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        B, V = logits.shape
        processed = md.max_num_logprobs is not None and md.logprobs_mode.startswith("processed")
        values = logits  # what logprobs are computed from: the raw logits unless processed
        empty = None  # [B] bool: the maskable rows left with no token
        rows = md.maskable_rows
        if md.all_greedy and md.plain:
            tokens = argmax(logits)  # nothing to process: no copy (and processed values are raw)
            if rows is not None:  # grammar rows (plain: no other mask); finite rows never match
                empty = argmax_is_masked(logits, tokens)
        else:
            x = self._buf("work", B, V, torch.float32, logits.device).copy_(logits)  # logits stay raw
            self.apply_logits_processors(x, md)
            if rows is not None:  # before _sample turns x into weights (an empty row's are NaN)
                empty = torch.zeros(B, dtype=torch.bool, device=x.device)
                empty.index_put_((rows,), rows_fully_masked(x, rows))
            kept = self._buf("processed", B, V, torch.float32, logits.device).copy_(x) if processed else None
            tokens, cut = self._sample(x, md, cutoffs=processed)
            if kept is not None:
                values = processed_logits(kept, md.temperature, cut)
        lp = None
        if md.max_num_logprobs is not None:
            work = self._buf("work", B, V, torch.float32, logits.device)  # free again: reuse it
            as_logits = md.logprobs_mode.endswith("logits")
            lp = logprobs_of(values, tokens, md.max_num_logprobs, work, as_logits, processed)
        if empty is not None:  # after the logprobs, which index by token (the runner drops an empty row's)
            tokens = tokens.masked_fill(empty, NO_TOKEN)
        return SamplerOutput(tokens, lp)

    def _buf(self, name: str, rows: int, cols: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A persistent [rows, cols] buffer. Fresh ones are zeroed; users of the zero-invariant
        "count" table put back zeros where they wrote: O(touched) per step, not O(B * V)."""
        buf = self._bufs.get(name)
        if buf is None or buf.numel() < rows * cols or buf.device != device or buf.dtype != dtype:
            buf = self._bufs[name] = torch.zeros(rows * cols, dtype=dtype, device=device)
        return buf[: rows * cols].view(rows, cols)

    def reset_buffers(self) -> None:
        """Drop the scratch buffers: after a draw that raised midway, the count table may not
        be all-zero any more, and every later draw would read its leftovers."""
        self._bufs.clear()

    def apply_logits_processors(self, x: torch.Tensor, md: SamplingMetadata) -> None:
        """Everything before temperature, in vLLM's order, in place on x [B, V]: allowed tokens,
        bad words, logit bias, then min_tokens and the penalties."""
        if md.token_rules is not None:
            md.token_rules.apply(x)
        self.apply_penalties(x, md)

    def apply_penalties(self, x: torch.Tensor, md: SamplingMetadata) -> None:
        """min_tokens, repetition, frequency and presence penalties, in place on x [B, V]."""
        B, V = x.shape
        apply_penalties(x, md, lambda: self._buf("count", B, V + 1, torch.int32, x.device))

    def _weights_and_cutoffs(self, x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                             top_p: torch.Tensor | None, min_p: torch.Tensor | None, max_top_k: int = 0
                             ) -> tuple[torch.Tensor, torch.Tensor]:
        """Turns x [R, V] (random rows, penalties applied) IN PLACE into unnormalised sampling
        weights (temperature, then min-p, top-k, top-p, each on what the previous kept), and
        returns them with each row's weight cutoff omega [R] (weights below it dropped)."""
        R, V = x.shape
        # exp((x - max) / T) as exp2((x - max) * log2(e) / T): torch's exp2 is ~2x faster than its
        # exp on CPU. w in [0, 1] and the row max is exactly 1 (exp2(0)).
        scale = (_LOG2E / temperature.to(torch.float64)).to(x.dtype)[:, None]
        w = x.sub_(x.amax(-1, keepdim=True)).mul_(scale).exp2_()
        omega = torch.full((R,), WEIGHT_FLOOR, dtype=x.dtype, device=x.device)
        if min_p is not None:  # vLLM: drop p < min_p * p_max, i.e. w < min_p
            omega = torch.maximum(omega, min_p.to(x.dtype))
        if top_k is not None or top_p is not None:
            k = top_k.clamp(max=V) if top_k is not None else None
            # max_top_k: the host's; reading k.max() back is a device sync (metadata built by hand)
            k_max = (max_top_k or int(k.max())) if k is not None else 1
            # Top-p looks at top_p_candidates first and widens the rows whose nucleus runs past
            # them, which asks the device whether any does (a sync); sync-free, one full sort
            # never needs widening. Same cutoffs either way (prefix sums).
            candidates = V if self._sync_free(x) else self.top_p_candidates
            width = max(min(k_max, V), 1 if top_p is None else candidates)
            vals = _topk(w, min(width, V))[0]  # sorted descending
            has_k = k > 0 if k is not None else torch.zeros(R, dtype=torch.bool, device=x.device)
            if k is not None:  # keep ties with the k-th value, like vLLM
                kth = vals.gather(1, (k - 1).clamp(min=0)[:, None]).squeeze(1)
                omega = torch.where(has_k, torch.maximum(omega, kth), omega)
            if top_p is not None:
                omega = torch.maximum(omega, self._top_p_cutoff(w, vals, omega, top_p, has_k, min_p))
        w.div_(omega[:, None])
        return F.threshold_(w, _BELOW_ONE, 0.0), omega

    def _sync_free(self, x: torch.Tensor) -> bool:
        return x.device.type != "cpu" if self.sync_free is None else self.sync_free

    def _top_p_cutoff(self, w: torch.Tensor, vals: torch.Tensor, omega: torch.Tensor, top_p: torch.Tensor,
                      has_k: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
        """Per-row weight cutoff keeping the smallest prefix (by weight) whose mass, within what
        min-p/top-k kept, reaches top_p. Prefix sums are sequential, so a row's cutoff does not
        depend on how many candidate columns the batch asked for."""
        K = vals.shape[1]
        active = top_p < 1.0
        kept = vals >= omega[:, None]
        cand = vals.to(torch.float64) * kept
        csum = cand.cumsum(-1)
        # Mass min-p/top-k kept: top-k rows from the candidates, others from the whole row, summed
        # by blocks (a lone [1, V] row sum is split over threads: its rounding would hang on B).
        w_z = w
        if min_p is not None and self._sync_free(w):  # all rows, no nonzero (a host sync)
            # One pass: min-p rows sum what min-p kept, the others their whole row.
            use = ((min_p > 0) & ~has_k & active)[:, None]
            w_z = torch.where(use & ~(w >= min_p[:, None]), 0.0, w)
            min_p = None
        z = _block_reduce(w_z, self.block_size, "sum").double().sum(-1)
        rows = None if min_p is None else ((min_p > 0) & ~has_k & active).nonzero().squeeze(1)
        if rows is not None and rows.numel():
            wm = w.index_select(0, rows)
            wm = torch.where(wm >= min_p[rows, None], wm, 0.0)  # type: ignore[index]
            z[rows] = _block_reduce(wm, self.block_size, "sum").double().sum(-1)
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
        """The distribution each row samples from [B, V], for tests/debugging (greedy rows: softmax of
        the penalised logits at temperature 1, whose argmax is their token)."""
        x = logits.to(torch.float32, copy=True)
        self.apply_logits_processors(x, md)
        probs = torch.softmax(x, dim=-1)
        rows = (md.temperature >= GREEDY_EPS).nonzero().squeeze(1)
        if rows.numel():
            w = self._weights_of_rows(x, md, rows)[0]
            probs[rows] = w / w.sum(-1, keepdim=True)
        return probs

    def _sample(self, x: torch.Tensor, md: SamplingMetadata, cutoffs: bool = False
                ) -> tuple[torch.Tensor, Cutoffs | None]:
        """Tokens [B]; with `cutoffs`, what truncation kept of the random rows (for the
        processed logprobs modes)."""
        if md.all_greedy:  # no weights, no hashing
            return argmax(x), None
        greedy = None if md.all_random else argmax(x)
        rows = None if md.all_random else md.random_rows
        if rows is None and not md.all_random:
            rows = (md.temperature >= GREEDY_EPS).nonzero().squeeze(1)
        w, omega = self._weights_of_rows(x, md, rows)  # greedy rows skip the random path
        keys = row_keys(_take(md.seeds, rows), _take(md.positions, rows))  # type: ignore[arg-type]
        tokens = self.race(w, keys)
        if greedy is not None:
            greedy[rows] = tokens
        return tokens if greedy is None else greedy, (rows, w, omega) if cutoffs else None

    def _weights_of_rows(self, x: torch.Tensor, md: SamplingMetadata, rows: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor]:  # of a copy of `rows`, or of x in place (None)
        t, k, p, m = (_take(v, rows) for v in (md.temperature, md.top_k, md.top_p, md.min_p))
        xr = x if rows is None else x.index_select(0, rows)
        return self._weights_and_cutoffs(xr, t, k, p, m, md.max_top_k)  # type: ignore[arg-type]

    def race(self, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """Two-level exponential race over nonnegative weights w [R, V] -> token ids [R]."""
        blocks = _block_reduce(w, self.block_size, "sum").to(torch.float64)
        arange_nb = torch.arange(blocks.shape[1], device=w.device)
        blk = (blocks / _exponentials(keys, arange_nb, _SALT_BLOCK)).argmax(-1, keepdim=True)
        wt, tok = _block_gather(w, blk, self.block_size, 0.0)
        j = (wt.to(torch.float64) / _exponentials(keys, tok, 0)).argmax(-1, keepdim=True)
        return tok.gather(1, j).squeeze(1)
