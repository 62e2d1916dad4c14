"""Logits processors of vLLM's SamplingParams, batched for the rows of one step: the token-level
ones (allowed_token_ids, bad_words, logit_bias: vLLM applies them, in this order, first), then
min_tokens and the penalties; and the processed logits the processed_* logprobs modes report.

Every id here passed `check_request` (range-checked against the vocabulary in the core), so
indexing cannot fail. A batch in which no row uses them builds nothing (`TokenRules.build`
returns None) and the sampler skips them at no cost.

Masks can leave a row nothing to sample (allowed_token_ids that are all bad words, or all stop
tokens under min_tokens, or outside a grammar): such a row samples NO_TOKEN (the sampler
looks at `maskable_rows` only), and the model runner fails its request alone with `every_token_masked`'s
words (vLLM would sample from all -inf logits: token 0 greedily, garbage at random).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

from tidal.protocol.sampling_params import SamplingParams
from tidal.protocol.sampling_params import GREEDY_EPS

if TYPE_CHECKING:
    from tidal.worker.sampler import SamplingMetadata


def device_tensor(values: Sequence | np.ndarray, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values, dtype, device)` without the host waiting for the device: on CUDA
    a plain host-to-device copy synchronizes the stream (the host would sit idle until the
    step's forward is done instead of preparing the sampling inputs meanwhile), so the values
    go through pinned memory (torch's cached host allocator) with a non-blocking copy."""
    t = torch.as_tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def bad_words_banned_now(sequences: Sequence[Sequence[int]], output: Sequence[int]) -> set[int]:
    """Tokens a row may not sample next (vLLM's rule): a one-token bad word always; the last
    token of a longer one when the output so far ends with the tokens before it."""
    banned: set[int] = set()
    n_out = len(output)
    for seq in sequences:
        head = len(seq) - 1
        if head == 0 or (head <= n_out and list(output[n_out - head:]) == list(seq[:head])):
            banned.add(seq[-1])
    return banned


NO_TOKEN = -1  # the token a row whose masks left nothing samples (never a vocabulary id)


def argmax_is_masked(x: torch.Tensor, greedy_tokens: torch.Tensor) -> torch.Tensor:
    """[B] bool: the rows of the masked logits x [B, V] whose argmax (`greedy_tokens`) is -inf,
    i.e. whose every entry is: one gather. No host sync."""
    return torch.isneginf(x.gather(1, greedy_tokens[:, None]).squeeze(1))


def rows_fully_masked(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[R] bool: which of `rows` of the masked logits x [B, V] have every entry -inf (a max per
    row, before sampling turns x into weights). Few rows are copied out first; many are read
    in place. No host sync."""
    if 2 * rows.shape[0] >= x.shape[0]:
        return torch.isneginf(x.amax(-1)).index_select(0, rows)
    return torch.isneginf(x.index_select(0, rows).amax(-1))


def maskable_rows(params: Sequence[SamplingParams], min_tokens: dict[int, set[int]], grammar_rows: Sequence[int],
                  vocab_size: int) -> list[int]:
    """The rows whose masks may leave no token (the sampler checks only these): a grammar's,
    and those whose bad words or min_tokens mask tokens beside allowed_token_ids (non-empty:
    alone it always leaves a token) or mask as many tokens as the vocabulary holds."""
    rows = set(grammar_rows)
    for i, p in enumerate(params):
        masked = len(min_tokens.get(i, ())) + len(p.bad_words_token_ids or ())  # each bad word bans <= 1
        if masked and (p.allowed_token_ids is not None or masked >= vocab_size):
            rows.add(i)
    return sorted(rows)


def every_token_masked(params: SamplingParams, output_token_ids: Sequence[int], eos_token_id: int | None,
                       grammar: bool) -> str:
    """The error of a request whose row had no token left after `output_token_ids`, naming
    the settings that masked it (`grammar`: its structured-output bitmask was applied too)."""
    causes: list[str] = []
    if params.allowed_token_ids is not None:
        causes.append(f"allowed_token_ids {_shown(params.allowed_token_ids)}")
    banned = bad_words_banned_now(params.bad_words_token_ids or (), output_token_ids)
    if banned:
        causes.append(f"bad_words (banning {_shown(sorted(banned))} now)")
    n = len(output_token_ids)
    if n < params.min_tokens:
        stops = sorted({*(params.stop_token_ids or ()), *(() if eos_token_id is None else (eos_token_id,))})
        causes.append(f"min_tokens={params.min_tokens} (masking the stop tokens {_shown(stops)} "
                      f"until {params.min_tokens} tokens are generated)")
    where = f"every token is masked for this request after {n} generated token{'' if n == 1 else 's'}"
    if not grammar:
        return f"{where}: {' and '.join(causes) or 'its settings'} leave no token to sample"
    kind = params.structured_outputs.kind if params.structured_outputs is not None else "grammar"
    others = " and ".join(causes) or "its other settings"
    return (f"{where}: the structured output grammar ({kind}) allows none of the tokens that {others} "
            f"leave; another setting (min_tokens, allowed_token_ids, bad_words) may have masked "
            f"every token the grammar allows")


def _shown(ids: Sequence[int], limit: int = 8) -> str:
    """Ids for an error message: all of a few, else the first ones and how many."""
    ids = list(ids)
    return str(ids) if len(ids) <= limit else f"{str(ids[:limit])[:-1]}, ...] ({len(ids)} in all)"


def needs_output_history(params: SamplingParams) -> bool:
    """Whether this row's token rules read the tokens it generated (multi-token bad words)."""
    return any(len(seq) > 1 for seq in params.bad_words_token_ids or ())


@dataclass
class TokenRules:
    """One step's masks and biases, as flat (row, token) index tensors."""

    allowed_rows: torch.Tensor | None  # [R] rows that restrict their tokens
    allowed_flat: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) of every allowed token
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row, token) of bad-word tokens banned now
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, token, value)

    @staticmethod
    def build(params: Sequence[SamplingParams], output_token_ids: Sequence[Sequence[int]],
              device: torch.device | str = "cpu") -> TokenRules | None:
        """None when no row uses allowed_token_ids, bad words or logit_bias."""
        if not any(p.uses_logits_processors for p in params):
            return None
        allowed_rows: list[int] = []
        allowed: tuple[list[int], list[int]] = ([], [])
        banned: tuple[list[int], list[int]] = ([], [])
        bias: tuple[list[int], list[int], list[float]] = ([], [], [])
        for row, p in enumerate(params):
            if p.allowed_token_ids is not None:
                allowed_rows.append(row)
                allowed[0].extend([row] * len(p.allowed_token_ids))
                allowed[1].extend(p.allowed_token_ids)
            if p.bad_words_token_ids:
                ids = bad_words_banned_now(p.bad_words_token_ids, output_token_ids[row])
                banned[0].extend([row] * len(ids))
                banned[1].extend(ids)
            if p.logit_bias:
                bias[0].extend([row] * len(p.logit_bias))
                bias[1].extend(p.logit_bias)
                bias[2].extend(p.logit_bias.values())

        def index(rows: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
            if not rows:
                return None
            return device_tensor(rows, torch.int64, device), device_tensor(ids, torch.int64, device)

        bias_index = index(bias[0], bias[1])
        return TokenRules(
            allowed_rows=device_tensor(allowed_rows, torch.int64, device) if allowed_rows else None,
            allowed_flat=index(*allowed), banned=index(*banned),
            bias=None if bias_index is None else (*bias_index, device_tensor(bias[2], torch.float32, device)))

    def apply(self, x: torch.Tensor) -> None:
        """In place on the float32 logits x [B, V]: allowed-only, bad words, then logit bias."""
        if self.allowed_rows is not None and self.allowed_flat is not None:
            keep = x[self.allowed_flat]
            x.index_fill_(0, self.allowed_rows, float("-inf"))
            x[self.allowed_flat] = keep
        if self.banned is not None:
            x[self.banned] = float("-inf")
        if self.bias is not None:
            rows, ids, values = self.bias
            x.index_put_((rows, ids), values.to(x.dtype), accumulate=True)


def apply_penalties(x: torch.Tensor, md: SamplingMetadata,
                    count_table: Callable[[], torch.Tensor]) -> None:
    """min_tokens, repetition, frequency and presence penalties, in place on x [B, V].
    `count_table()` is an all-zero int32 [B, V + 1] scratch table, left all-zero again."""
    V = x.shape[1]
    if md.min_tokens:
        rc = device_tensor([(r, t) for r, ids in md.min_tokens.items() for t in ids], torch.int64, x.device)
        x[rc[:, 0], rc[:, 1]] = float("-inf")
    if md.no_penalties:
        return
    # Penalties touch only tokens seen in prompt/output: gather, edit, scatter back (no [B, V] pass).
    rep, freq, pres = md.repetition_penalties, md.frequency_penalties, md.presence_penalties
    width = max((len(o) for o in md.output_token_ids), default=0)
    out = device_tensor([o + [V] * (width - len(o)) for o in md.output_token_ids], torch.int64, x.device)
    prompt = md.prompt_token_ids if rep is not None else None
    idx = out if prompt is None else torch.cat([out, prompt.to(x.device)], 1)  # padded with V
    if idx.shape[1] == 0:
        return
    # Padding then points at token 0. Every entry's new value is a function of its token
    # alone (logit, count, presence), so duplicate writes to one token agree.
    fixed = idx.masked_fill(idx >= V, 0)
    g = x.gather(1, fixed)
    if rep is not None:  # every real entry is present; padding is as present as token 0
        present = (idx < V) | (idx == 0).any(-1, keepdim=True)
        g = torch.where(present, torch.where(g > 0, g / rep[:, None], g * rep[:, None]), g)
    if width and (freq is not None or pres is not None):
        table = count_table()  # column V: padding
        c = table.scatter_add_(1, out, torch.ones_like(out, dtype=torch.int32)).gather(1, fixed).to(x.dtype)
        table.scatter_(1, out, 0)  # back to all-zero, touching only what was written
        g = g - (0 if freq is None else freq[:, None] * c)
        g = g - (0 if pres is None else pres[:, None] * (c > 0).to(x.dtype))
    x.scatter_(1, fixed, g)


# What the random path's truncation kept: (rows sampled at random, None = all; their weights
# [R, V] after truncation, 0 = dropped; their weight cutoffs [R]).
Cutoffs = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]
# Sampling weights below this are dropped in every row (the sampler's floor); a row's cutoff
# above it means top-k/top-p/min-p truncated the row.
WEIGHT_FLOOR = 2.0**-100


def processed_logits(x: torch.Tensor, temperature: torch.Tensor, cut: Cutoffs | None) -> torch.Tensor:
    """vLLM's processed logits, in place on x [B, V] (the logits after masks, bias and penalties):
    divided by the temperature (greedy rows: by 1) and -inf where min-p / top-k / top-p
    dropped a token. Computed from the logits, not the weights, so that unlikely tokens keep
    their finite value as in vLLM."""
    x.div_(torch.where(temperature < GREEDY_EPS, 1.0, temperature).to(x.dtype)[:, None])
    if cut is None:
        return x
    rows, w, omega = cut
    truncated = omega > WEIGHT_FLOOR  # rows whose cutoff dropped tokens (the floor drops fewer)
    if not bool(truncated.any()):
        return x
    dropped = (w == 0) & truncated[:, None]
    if rows is None:
        return x.masked_fill_(dropped, float("-inf"))
    x[rows] = x[rows].masked_fill_(dropped, float("-inf"))
    return x



def apply_token_bitmask(x: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Structured outputs: in place on the logits x [B, V], rows[i] keeps only the tokens whose
    bit is set in bitmask[i] ([R, ceil(V / 32)] int32, bit t % 32 of word t // 32, xgrammar's
    layout); the others become -inf. Rows not in `rows` are not touched.

    CPU: numpy unpacks the bits, then one in-place fill per row. Per-row ops stay below torch's
    parallel grain for common vocabularies, so they never wait on a thread barrier (which a
    batched [R, V] gather/scatter pays several times over on a busy machine). Other devices:
    the packed words are sent (V / 8 bytes a row) and unpacked there by shifts."""
    V = x.shape[1]
    words = np.ascontiguousarray(bitmask, dtype="<i4")
    if x.device.type == "cpu":
        # 1 = forbidden; bool is one byte of 0/1, so unpackbits' output views as bool as is.
        forbidden = torch.from_numpy(np.unpackbits((~words).view(np.uint8), axis=1, bitorder="little").view(np.bool_))
        width = min(V, forbidden.shape[1])
        for i, row in enumerate(rows):
            x[row, :width].masked_fill_(forbidden[i, :width], float("-inf"))
            if width < V:  # no bit for these tokens: forbidden
                x[row, width:] = float("-inf")
        return
    apply_token_bitmask_by_shifts(x, words, rows)


def apply_token_bitmask_by_shifts(x: torch.Tensor, words: np.ndarray, rows: list[int]) -> None:
    """`apply_token_bitmask` for accelerators, as a few batched ops on x's device (any device
    runs it: the tests check it on CPU against the CPU path)."""
    V = x.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=x.device)
    bits = device_tensor(np.ascontiguousarray(words, dtype="<i4"), torch.int32, x.device)
    allowed = ((bits[:, :, None] >> shifts) & 1).view(bits.shape[0], -1)  # [R, 32 * words]
    if allowed.shape[1] < V:
        allowed = torch.nn.functional.pad(allowed, (0, V - allowed.shape[1]))
    index = device_tensor(rows, torch.int64, x.device)
    x[index] = x.index_select(0, index).masked_fill_(allowed[:, :V] == 0, float("-inf"))
