"""Sampling parameters, with vLLM's field names and value ranges.

`SamplingParams` is a msgspec Struct so that it travels inside `EngineCoreRequest` without a
second schema; `__post_init__` runs on construction *and* on decode, so a malformed request from
the wire is rejected by the same checks as a user's.
"""
from __future__ import annotations

import enum
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

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self._verify()
        if self.top_k == -1:  # vLLM's spelling of "disabled"
            self.top_k = 0
        if self.temperature < GREEDY_EPS:
            # Greedy: the truncation knobs cannot change argmax; normalise so the batched
            # sampler can skip them (vLLM does the same).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        return cls(**{k: v for k, v in kwargs.items() if v is not None})

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def _verify(self) -> None:
        """Raise ValueError naming the first field out of its range; changes nothing."""
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {getattr(self, name)!r}.")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "must be greater than zero")
        if not self.temperature >= 0.0:
            raise bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k < -1:
            raise bad("top_k", "must be -1 or 0 (disable), or at least 1")
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
        if self.logprobs is not None and self.logprobs < 0:
            raise bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise bad("prompt_logprobs", "must be non-negative")
        if any(not s for s in self.stop):  # type: ignore[union-attr]
            raise ValueError("stop cannot contain an empty string.")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids}.")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True.")

    def clone(self, **changes: Any) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
