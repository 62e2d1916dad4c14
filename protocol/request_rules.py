"""The rules every request must meet before it is queued, written once (torch-free).

The front-end raises `ValueError(check_request(...))`; the engine core, which must not trust any
client, turns the same text into the request's ERROR output. The scheduler trusts its caller.
"""
from __future__ import annotations

from dataclasses import dataclass

from tidal.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The engine's limits a request is checked against (known once the core is up)."""

    max_model_len: int
    vocab_size: int
    max_logprobs: int


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: RequestLimits,
                  eos_token_id: int | None = None) -> str | None:
    """What is wrong with this request, in one sentence naming the value and the limit; None
    when it can run. `params` already passed SamplingParams' own checks."""
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
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > limits.max_logprobs:
            return f"requested {name}={k} exceeds max_logprobs {limits.max_logprobs}"
    for t in params.stop_token_ids or ():
        if t >= vocab:
            return f"stop_token_ids holds {t}, out of vocabulary range [0, {vocab})"
    if eos_token_id is not None and not 0 <= eos_token_id < vocab:
        return f"eos_token_id {eos_token_id} is out of vocabulary range [0, {vocab})"
    return None
