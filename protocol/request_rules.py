"""The rules every request must meet before it is queued, written once (torch-free).

The front-end raises `ValueError(check_request(...))`; the engine core, which must not trust any
client, turns the same text into the request's ERROR output. The scheduler trusts its caller.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from tidal.protocol.sampling_params import INT64_MAX, INT64_MIN, SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits a request is checked against (known once the core is up)."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int
    scheduling_policy: str = "fcfs"  # a priority other than 0 needs "priority"


def check_priority(priority: int, scheduling_policy: str) -> str | None:
    """vLLM's rule (and words): a priority needs priority scheduling; it must fit the wire."""
    if isinstance(priority, bool) or not isinstance(priority, int):
        return f"priority must be an integer, got {priority!r}"
    if not INT64_MIN <= priority <= INT64_MAX:
        return f"priority must fit in a signed 64-bit integer, got {priority}"
    if priority != 0 and scheduling_policy != "priority":
        return f"Got priority {priority} but Priority scheduling is not enabled."
    return None


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits,
                  eos_token_id: int | None = None, priority: int = 0) -> str | None:
    """What is wrong with this request, in one sentence naming the value and the limit; None
    when it can run. `params` already passed SamplingParams' own checks."""
    if problem := check_priority(priority, limits.scheduling_policy):
        return problem
    if params.extra_args is not None:  # a front-end's own: it never travels to the core
        return "extra_args must not be sent to the engine core"
    n, max_len, vocab = len(prompt_token_ids), limits.max_model_len, limits.vocab_size
    if n == 0:
        return "the prompt is empty: it must hold at least one token"
    if n > max_len:
        return f"prompt length {n} exceeds max_model_len {max_len}"
    if n == max_len:  # at least one token must be generated
        return f"prompt length {n} leaves no room to generate within max_model_len {max_len}"
    # max_tokens past the context window is no error (as in vLLM): the engine stops the
    # request at max_model_len with finish_reason "length".
    lo, hi = min(prompt_token_ids), max(prompt_token_ids)
    if lo < 0 or hi >= vocab:
        return f"prompt token id {lo if lo < 0 else hi} is out of vocabulary range [0, {vocab})"
    problem = _check_logprobs(params, limits)
    if problem is None:
        problem = _check_token_ids(params, vocab)
    if problem is None and eos_token_id is not None and not 0 <= eos_token_id < vocab:
        problem = f"eos_token_id {eos_token_id} is out of vocabulary range [0, {vocab})"
    return problem


def num_logprobs(k: int | None, vocab_size: int) -> int:
    """How many logprobs `k` asks for (vLLM's rule: -1 means the whole vocabulary; None: 0)."""
    return vocab_size if k == -1 else k or 0


def _check_logprobs(params: SamplingParams, limits: RequestLimits) -> str | None:
    """`num_logprobs`' rule, and max_logprobs=-1 allows the whole vocabulary. More than the
    vocabulary holds is refused too, under a max_logprobs above it (vLLM's top-k would raise
    in the sampler: this request's mistake must not reach it)."""
    vocab = limits.vocab_size
    most = num_logprobs(limits.max_logprobs, vocab)
    for name, what in (("logprobs", "sample"), ("prompt_logprobs", "prompt")):
        k = getattr(params, name)
        if k is not None and (k := num_logprobs(k, vocab)) > most:
            return (f"Requested {what} logprobs of {k}, which is greater than max allowed: {most} "
                    f"({name}={getattr(params, name)}, max_logprobs={limits.max_logprobs})")
        if k is not None and k > vocab:
            return (f"Requested {what} logprobs of {k}, which is greater than the vocabulary size {vocab} "
                    f"({name}={k}; -1 asks for the whole vocabulary)")
    return None


def _show(ids: list[int], shown: int = 8) -> str:
    """Ids for an error message: all of a few, else the first ones and how many in all (a
    request may carry 100,000, and the message goes back to its client)."""
    if len(ids) <= shown:
        return str(ids)
    return f"{str(ids[:shown])[:-1]}, ...] ({len(ids)} in all)"


def _out_of_range(ids: Iterable[int], vocab: int) -> list[int]:
    return [t for t in ids if not 0 <= t < vocab]


def _check_token_ids(params: SamplingParams, vocab: int) -> str | None:
    """Every token id the sampler will index with, checked against the vocabulary: from the
    wire, an id out of range must fail its request, never the sampler (and the engine)."""
    if bad := _out_of_range(params.stop_token_ids or (), vocab):
        return (f"token_id(s) {_show(bad)} in stop_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {vocab} (ids out of vocabulary range [0, {vocab}))")
    allowed = params.allowed_token_ids
    if allowed is not None and not allowed:
        return "allowed_token_ids is not None and empty!"
    if allowed is not None and (bad := _out_of_range(allowed, vocab)):
        return f"allowed_token_ids contains out-of-vocab token id! {_show(bad)} not in [0, {vocab})"
    if params.logit_bias and (bad := _out_of_range(params.logit_bias, vocab)):
        return f"token_id(s) {_show(bad)} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}"
    sequences = params.bad_words_token_ids or ()
    if any(not seq for seq in sequences):
        return "bad_words token ids hold an empty sequence"
    if bad := _out_of_range((t for seq in sequences for t in seq), vocab):
        return (f"The model vocabulary size is {vocab}, but the following tokens were specified as "
                f"bad: {_show(bad)}. All token id values should be integers satisfying: 0 <= token_id <= {vocab - 1}.")
    return None
