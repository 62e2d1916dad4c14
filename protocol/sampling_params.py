"""Sampling parameters, with vLLM's field names and value ranges.

`SamplingParams` is a msgspec Struct so that it travels inside `EngineCoreRequest` without a
second schema; `__post_init__` runs on construction *and* on decode, so a malformed request from
the wire is rejected by the same checks as a user's.
"""
from __future__ import annotations

import enum
import math
import numbers
import operator
from typing import TYPE_CHECKING, Any

import msgspec

from tidal.protocol import envs
from tidal.protocol.structured_outputs import StructuredOutputsParams


# Temperatures below this sample greedily (argmax); SamplingParams and the sampler agree on it.
GREEDY_EPS = 1e-5

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1  # what an int field on the wire can carry
UINT64_MAX = (1 << 64) - 1  # a seed may use the whole unsigned range too (the sampler hashes 64 bits)

if TYPE_CHECKING:
    FrontEndOnly = dict[str, Any] | None
else:
    # extra_args never travel: the input processor strips them, and the core's decoder takes
    # only null in their place, so no untyped (Any) value is ever decoded from the wire.
    FrontEndOnly = None

# Fields checked for type by _check_types (the wire's msgspec types; ranges are _verify's).
_INTS = ("n", "top_k", "min_tokens")
_OPTIONAL_INTS = ("seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens")
_FLOATS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")
_BOOLS = ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
          "include_stop_str_in_output", "flat_logprobs")


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the previous one
    FINAL_ONLY = 2  # a single output when the request finishes


class SamplingParams(
    msgspec.Struct, array_like=True, omit_defaults=True, dict=False
):  # type: ignore[call-arg]
    # Positional arguments are taken as vLLM's are: its field order, n first, holds up to
    # prompt_logprobs (`SamplingParams(n, temperature=...)` is seen in users' code).
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
    extra_args: FrontEndOnly = None
    bad_words: list[str] | None = None  # never completed in the output (see bad_words_token_ids)
    # Set by the front-end from bad_words (both with and without a leading space, as vLLM does).
    _bad_words_token_ids: list[list[int]] | None = None
    # Constrained decoding (JSON schema, regex, choice, grammar; the core compiles it with xgrammar).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _str_list("stop", self.stop)
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids)
        self.bad_words = list(dict.fromkeys(_str_list("bad_words", self.bad_words)))
        if self.seed == -1:  # vLLM's spelling of "no seed" (one is drawn per request)
            self.seed = None
        self._check_types()
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
        flat_logprobs: bool = False, structured_outputs: StructuredOutputsParams | None = None,
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
            extra_args=extra_args, flat_logprobs=flat_logprobs, structured_outputs=structured_outputs)

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

    def _check_types(self) -> None:
        """Every field as the wire carries it (a ValueError here, never an encoder's
        OverflowError or the core's "malformed request"): ints are plain ints within int64
        (anything with __index__ is taken, True as 1 as in vLLM), floats are floats, flags are
        bools. Normalises in place, so it runs before the range checks."""
        # Plain values (the common case, and every decoded one) skip the conversions.
        for name in _INTS + _OPTIONAL_INTS:
            value = getattr(self, name)
            hi = UINT64_MAX if name == "seed" else INT64_MAX
            if type(value) is int and INT64_MIN <= value <= hi or value is None and name not in _INTS:
                continue
            # tidal refused a bool truncation size before; it stays refused.
            setattr(self, name, _as_int(name, value, allow_bool=name != "truncate_prompt_tokens", hi=hi))
        for name in _FLOATS:
            if type(value := getattr(self, name)) is not float:
                setattr(self, name, _as_float(name, value))
        for name in _BOOLS:
            if type(value := getattr(self, name)) is not bool:
                raise ValueError(f"{name} must be a bool, got {type(value).__name__}.")
        self.allowed_token_ids = (None if self.allowed_token_ids is None
                                  else _int_list("allowed_token_ids", self.allowed_token_ids))
        if type(self.output_kind) is not RequestOutputKind:
            self.output_kind = _output_kind(self.output_kind)
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {type(so).__name__}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {type(self.extra_args).__name__}.")

    def _verify(self) -> None:
        """Raise ValueError naming the first field out of its range; changes nothing."""
        def bad(name: str, rule: str) -> ValueError:
            return ValueError(f"{name} {rule}, got {getattr(self, name)!r}.")

        if self.n < 1:
            raise bad("n", "must be at least 1")
        # Each of the n is a request of its own in the engine: an unbounded n from one client
        # would stall (or exhaust) the front-end and the core. vLLM's VLLM_MAX_N_SEQUENCES.
        if self.n > (limit := envs.TIDAL_MAX_N_SEQUENCES):
            raise bad("n", f"must be at most {limit} (TIDAL_MAX_N_SEQUENCES)")
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
        if any(t < 0 for t in self.stop_token_ids):  # type: ignore[union-attr]
            raise ValueError(f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids}.")
        if self.seed is not None and self.seed > UINT64_MAX - (self.n - 1):
            raise ValueError(f"seed + n - 1 must fit in 64 bits (the n > 1 children are seeded "
                             f"seed + i), got seed={self.seed}, n={self.n}.")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are only supported when detokenize is True. "
                             "Set detokenize=True to use stop.")
        self._verify_token_features()

    def _verify_token_features(self) -> None:
        """Ranges of the fields added with vLLM's token-level features. Their ids (and the
        front-end's bad-word sequences) are checked against the vocabulary by check_request,
        which fails one request rather than dropping a message from the wire."""
        if any(not w for w in self.bad_words):  # type: ignore[union-attr]
            raise ValueError(f"bad_words cannot contain an empty string. Got bad_words={self.bad_words}")
        t = self.truncate_prompt_tokens
        if t is not None and (t == 0 or t < -1):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {t}")

    def clone(self, **changes: Any) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)


def _as_int(name: str, value: Any, allow_bool: bool = True, hi: int = INT64_MAX) -> int:
    """`value` as a plain int the wire can carry (numpy ints included), else ValueError."""
    if (isinstance(value, bool) and not allow_bool) or not hasattr(value, "__index__"):
        if name == "top_k":  # vLLM's words
            raise ValueError(f"top_k must be an integer, got {type(value).__name__}")
        raise ValueError(f"{name} must be an integer, got {value!r} ({type(value).__name__}).")
    value = operator.index(value)
    if not INT64_MIN <= value <= hi:
        bits = "a signed or unsigned 64-bit" if hi == UINT64_MAX else "a signed 64-bit"
        raise ValueError(f"{name} must fit in {bits} integer, got {value}.")
    return int(value)


def _as_float(name: str, value: Any) -> float:
    """`value` (any real number but a string) as a float, else ValueError; ranges are _verify's."""
    try:
        if isinstance(value, numbers.Real):
            return float(value)
    except OverflowError:  # an int past float's range
        pass
    raise ValueError(f"{name} must be a number within float range, got {value!r} ({type(value).__name__}).")


def _int_list(name: str, values: Any) -> list[int]:
    """A list of token ids (None: empty), each a plain int64 int; no bools, which are no ids."""
    if values is None or type(values) is list and not values:
        return []
    if not isinstance(values, (list, tuple)):
        raise ValueError(f"{name} must be a list of integers, got {type(values).__name__}.")
    if all(type(t) is int and INT64_MIN <= t <= INT64_MAX for t in values):
        return list(values)  # the common case, without a call per id
    if any(isinstance(t, bool) for t in values):
        raise ValueError(f"{name} must contain only integers, got {values}.")
    return [_as_int(name, t) for t in values]


def _str_list(name: str, values: Any) -> list[str]:
    """A list of strings (None: empty), each encodable as UTF-8 (a lone surrogate is not)."""
    if values is None or type(values) is list and not values:
        return []
    if not isinstance(values, (list, tuple)) or not all(isinstance(v, str) for v in values):
        raise ValueError(f"{name} must be a str or a list of str, got {values!r}.")
    for v in values:
        if not v.isascii():  # ASCII is UTF-8; only other text can hold a lone surrogate
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ValueError(f"{name} must be valid UTF-8 text, got {v!r} ({e.reason}).") from None
    return list(values)


def _output_kind(value: Any) -> RequestOutputKind:
    if isinstance(value, RequestOutputKind):
        return value
    try:
        return RequestOutputKind(_as_int("output_kind", value, allow_bool=False))
    except ValueError:
        raise ValueError(f"output_kind must be a RequestOutputKind, got {value!r}.") from None


def _clamped_logit_bias(bias: Any) -> dict[int, float]:
    """Int keys (JSON clients send strings) within int64, values clamped to [-100, 100] as vLLM
    does (so a NaN or infinite bias can never reach the sampler)."""
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id to bias, got {type(bias).__name__}.")
    out: dict[int, float] = {}
    bad = []
    for token, value in bias.items():
        try:
            token_id = int(token)
            if isinstance(token, (bool, float)) and token != token_id or not INT64_MIN <= token_id <= INT64_MAX:
                raise ValueError(token)
        except (TypeError, ValueError):
            bad.append(token)
            continue
        out[token_id] = min(100.0, max(-100.0, _as_float(f"logit_bias[{token!r}]", value)))
    if bad:
        raise ValueError(f"logit_bias contains key(s) that cannot be converted to integer token IDs: {bad!r}")
    return out
