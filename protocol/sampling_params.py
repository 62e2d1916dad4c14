"""Sampling parameters, with vLLM's field names and value ranges.

`SamplingParams` is a msgspec Struct so that it travels inside `EngineCoreRequest` without a
second schema; `__post_init__` runs on construction *and* on decode, so a malformed request from
the wire is rejected by the same checks as a user's.
"""
from __future__ import annotations

import enum
import math
from typing import Any

import msgspec

from tidal.protocol.utils import GREEDY_EPS


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # a single output when the request finishes


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True, dict=False
):  # type: ignore[call-arg]
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # Added after the first wire version: last, with defaults (vLLM's names and meanings).
    flat_logprobs: bool = False  # logprobs as one FlatLogprobs per output, not a list of dicts
    truncate_prompt_tokens: int | None = None  # keep the last k prompt tokens (-1: max_model_len)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None  # every other token is masked
    # Carried for custom samplers and plugins, unused by tidal; the front-end keeps it and does
    # not send it to the core (the wire carries typed fields only).
    extra_args: dict[str, Any] | None = None
    bad_words: list[str] | None = None  # never completed in the output (see bad_words_token_ids)
    # Set by the front-end from bad_words (both with and without a leading space, as vLLM does).
    _bad_words_token_ids: list[list[int]] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.bad_words = [] if self.bad_words is None else list(dict.fromkeys(self.bad_words))
        if self.logprobs is True:  # vLLM's spelling of 1
            self.logprobs = 1
        if self.prompt_logprobs is True:
            self.prompt_logprobs = 1
        if self.logit_bias:
            self.logit_bias = _clamped_logit_bias(self.logit_bias)
        self._verify()
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            self.top_k = 0
        if self.temperature < GREEDY_EPS:
            # Greedy: the truncation knobs cannot change argmax; normalise so the batched
            # sampler can skip them (vLLM does the same).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @staticmethod
    def from_optional(
        n: int | None = 1, presence_penalty: float | None = 0.0, frequency_penalty: float | None = 0.0,
        repetition_penalty: float | None = 1.0, temperature: float | None = 1.0, top_p: float | None = 1.0,
        top_k: int = 0, min_p: float = 0.0, seed: int | None = None, stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None, bad_words: list[str] | None = None,
        include_stop_str_in_output: bool = False, ignore_eos: bool = False, max_tokens: int | None = 16,
        min_tokens: int = 0, logprobs: int | None = None, prompt_logprobs: int | None = None,
        detokenize: bool = True, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True,
        truncate_prompt_tokens: int | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        logit_bias: dict[int, float] | dict[str, float] | None = None,
        allowed_token_ids: list[int] | None = None, extra_args: dict[str, Any] | None = None,
        flat_logprobs: bool = False,
    ) -> "SamplingParams":
        """vLLM's constructor for API servers: None means "the default" for n, the penalties,
        temperature and top_p; the rest pass through (max_tokens=None: up to the context)."""
        return SamplingParams(
            n=1 if n is None else n,
            presence_penalty=0.0 if presence_penalty is None else presence_penalty,
            frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
            repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            top_k=top_k, min_p=min_p, seed=seed, stop=stop, stop_token_ids=stop_token_ids,
            bad_words=bad_words, include_stop_str_in_output=include_stop_str_in_output,
            ignore_eos=ignore_eos, max_tokens=max_tokens, min_tokens=min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, detokenize=detokenize, skip_special_tokens=skip_special_tokens,
            spaces_between_special_tokens=spaces_between_special_tokens,
            truncate_prompt_tokens=truncate_prompt_tokens, output_kind=output_kind,
            logit_bias=logit_bias, allowed_token_ids=allowed_token_ids,  # type: ignore[arg-type]
            extra_args=extra_args, flat_logprobs=flat_logprobs)

    @property
    def bad_words_token_ids(self) -> list[list[int]] | None:
        """The token sequences bad_words became (set by the front-end's tokenizer)."""
        return self._bad_words_token_ids

    @property
    def uses_logits_processors(self) -> bool:
        """Whether the sampler must mask or bias this row's logits (beyond min_tokens)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self._bad_words_token_ids)

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def _verify(self) -> None:
        """Raise ValueError naming the first field out of its range; changes nothing."""
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int):
            raise ValueError(f"n must be an int, but is of type {type(self.n)}")
        if self.n < 1:
            raise bad("n", "must be at least 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not math.isfinite(self.repetition_penalty):
            raise bad("repetition_penalty", "must be a finite number")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be greater than zero")
        if not math.isfinite(self.temperature):
            raise bad("temperature", "must be a finite number")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {type(self.top_k).__name__}")
        if self.top_k < -1:
            raise bad("top_k", "must be 0 (disable), or at least 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", "must be greater than or equal to 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}."
            )
        for name in ("logprobs", "prompt_logprobs"):  # -1: the whole vocabulary
            if getattr(self, name) is not None and getattr(self, name) < -1:
                raise bad(name, "must be non-negative or -1")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            raise ValueError("stop cannot contain an empty string.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError(f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")
        self._verify_token_features()

    def _verify_token_features(self) -> None:
        """Types of the fields added with vLLM's token-level features. Their ids (and the
        front-end's bad-word sequences) are checked against the vocabulary by check_request,
        which fails one request rather than dropping a message from the wire."""
        if any(not isinstance(w, str) or not w for w in self.bad_words):  # type: ignore[union-attr]
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")
        ids = self.allowed_token_ids
        if ids is not None and any(isinstance(t, bool) or not isinstance(t, int) for t in ids):
            raise ValueError(f"allowed_token_ids must contain only integers, got {ids}.")
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or t == 0 or t < -1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t}")

    def clone(self, **changes: Any) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _clamped_logit_bias(bias: dict[Any, Any]) -> dict[int, float]:
    """Int keys (JSON clients send strings), values clamped to [-100, 100] as vLLM does (so a
    NaN or infinite bias can never reach the sampler)."""
    out: dict[int, float] = {}
    bad = []
    for token, value in bias.items():
        try:
            token_id = int(token)
            if isinstance(token, (bool, float)) and token != token_id:
                raise ValueError(token)
            out[token_id] = min(100.0, max(-100.0, float(value)))
        except (TypeError, ValueError):
            bad.append(token)
    if bad:
        raise ValueError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}")
    return out
