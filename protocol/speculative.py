"""vLLM's `speculative_config` (engine arg): what tidal implements of it, checked once, torch-free.

tidal's speculative decoding never changes a token (DESIGN.md, Determinism): a proposed token is
accepted exactly when it equals the token the target samples at that position with the
request's (seed, position) noise, the first mismatch is replaced by that token, and when every
proposal is accepted the last row's token is emitted too (the bonus). So the proposals only
decide how many tokens a step yields.

Implemented: `method="ngram"` (prompt lookup: vLLM's NgramProposer rule, core/spec_decode.py)
with vLLM's keys and defaults: `num_speculative_tokens` (required), `prompt_lookup_max` /
`prompt_lookup_min` (both unset: 5 and 5; one unset: the other's value), and
`disable_by_batch_size` (no proposals in a step while that many requests or more run); and a
draft model (`{"model": PATH, "num_speculative_tokens": k}`, method `"draft_model"` as vLLM
infers it), run in the target's workers and sampled with the target's (seed, position) noise
(worker/draft_model.py). Other methods (EAGLE, MTP, medusa, suffix) are refused, naming the
method.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# vLLM's keys that only matter for a draft model / EAGLE / MTP: accepted only unset.
_DRAFT_MODEL_KEYS = (
    "draft_tensor_parallel_size", "tensor_parallel_size", "quantization", "max_model_len", "revision",
    "code_revision", "enforce_eager", "disable_padded_drafter_batch", "speculative_token_tree",
    "parallel_drafting", "draft_sample_method", "moe_backend", "attention_backend", "kv_cache_dtype",
)
# vLLM's (current and V0-era) keys that tidal has nothing to do with under n-gram: accepted at
# their defaults only (a value would change nothing, which should not pass silently).
_NGRAM_IRRELEVANT_DEFAULTS: dict[str, Any] = {
    "rejection_sample_method": "standard",
    "disable_log_stats": None,
    "disable_mqa_scorer": None,
    "acceptance_method": None,
}
_IMPLEMENTED_KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
                     "disable_by_batch_size")
IMPLEMENTED_METHODS = ("ngram", "draft_model")
_NGRAM_DEFAULT_LOOKUP = 5  # vLLM's, when neither prompt_lookup_min nor prompt_lookup_max is given


@dataclass(frozen=True)
class SpeculativeConfig:
    """The resolved speculative-decoding settings (build it with `from_value`)."""

    method: str = "ngram"
    num_speculative_tokens: int = 1
    prompt_lookup_max: int = _NGRAM_DEFAULT_LOOKUP
    prompt_lookup_min: int = _NGRAM_DEFAULT_LOOKUP
    # vLLM's: speculation steps aside (no proposals) in a step while this many requests or more
    # run (verification is then no longer nearly free). None: never.
    disable_by_batch_size: int | None = None
    model: str | None = None  # the draft model's checkpoint directory (method "draft_model")

    def __post_init__(self) -> None:
        if self.method not in IMPLEMENTED_METHODS:
            raise ValueError(_refusal(self.method))
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1)
        if (self.method == "draft_model") != isinstance(self.model, str) or self.model == "":
            raise ValueError("speculative_config: a draft model (method 'draft_model') needs model=PATH, "
                             "and only it takes one")
        _check_int("prompt_lookup_max", self.prompt_lookup_max, 1)
        _check_int("prompt_lookup_min", self.prompt_lookup_min, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min={self.prompt_lookup_min} must be <= "
                             f"prompt_lookup_max={self.prompt_lookup_max}")
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 2)

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        """The engine arg (vLLM's dict, the CLI's JSON, or one of these) resolved as vLLM
        resolves it; None when speculation is off (None or {}). ValueError for a method tidal
        does not implement (named), unknown keys (the known ones named), bad values."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(value).__name__}")
        if not value:
            return None
        known = (*_IMPLEMENTED_KEYS, *_DRAFT_MODEL_KEYS, *_NGRAM_IRRELEVANT_DEFAULTS)
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"tidal implements {', '.join(_IMPLEMENTED_KEYS)}")
        method, model = value.get("method"), value.get("model")
        if method is None:  # vLLM: the method follows from the model
            method = "ngram" if model in ("ngram", "[ngram]") else ("draft_model" if model is not None else None)
        if method == "[ngram]":
            method = "ngram"
        if method is None:
            raise ValueError("speculative_config: speculative decoding needs a method (tidal implements "
                             f"{', '.join(repr(m) for m in IMPLEMENTED_METHODS)}) or a model")
        if method not in IMPLEMENTED_METHODS:
            raise ValueError(_refusal(method))
        draft = method == "draft_model"
        if not draft and model not in (None, "ngram", "[ngram]"):
            raise ValueError(f"speculative_config: method {method!r} takes no draft model, got model={model!r}")
        if draft and not (isinstance(model, str) and model):
            raise ValueError("speculative_config: method 'draft_model' needs model (the draft checkpoint's path)")
        for key in _DRAFT_MODEL_KEYS:
            if value.get(key) is not None:
                raise ValueError(f"speculative_config: {key} is not supported: tidal runs the draft model "
                                 "with the target's dtype, tensor parallelism and context length" if draft else
                                 f"speculative_config: {key} applies to draft-model speculation (method "
                                 f"{method!r} has no draft model)")
        for key in ("prompt_lookup_max", "prompt_lookup_min") if draft else ():
            if value.get(key) is not None:
                raise ValueError(f"speculative_config: {key} applies to n-gram speculation, not to a draft model")
        k = value.get("num_speculative_tokens")
        if k is None:
            raise ValueError("speculative_config: speculative decoding needs num_speculative_tokens "
                             "(an integer >= 1)")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        if lo is None and hi is None:
            lo = hi = _NGRAM_DEFAULT_LOOKUP
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_max=hi, prompt_lookup_min=lo,
                   disable_by_batch_size=value.get("disable_by_batch_size"), model=model if draft else None)


def _refusal(method: object) -> str:
    return (f"speculative_config: tidal does not support speculative decoding by method {method!r} yet; "
            f"implemented: {', '.join(repr(m) for m in IMPLEMENTED_METHODS)}")


def _check_int(name: str, value: object, lowest: int) -> None:
    if type(value) is not int or value < lowest:
        raise ValueError(f"speculative_config: {name} must be an integer >= {lowest}, got {value!r}")
