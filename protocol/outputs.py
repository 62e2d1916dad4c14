"""User-facing outputs, with vLLM's names and fields.

`RequestOutput` and `CompletionOutput` accept unknown keyword arguments and keep them as
attributes: vLLM's forward-compatibility contract, so code written for a newer vLLM that passes
a field tidal lacks still constructs them.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping, MutableSequence, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, ClassVar, TypeVar, overload

FinishReasonStr = str  # "stop" | "length" | "abort" | "error"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = dict[int, Logprob]


@dataclass(eq=False)
class FlatLogprobs(MutableSequence[LogprobsOnePosition | None]):  # type: ignore[misc]
    """vLLM's flat container (`SamplingParams(flat_logprobs=True)`): every position's entries
    in a few flat lists instead of one dict and k Logprob objects per position, so a long
    output costs the garbage collector a constant number of objects. It reads as the nested
    form: `flat[i]` is position i's dict (`{}` for a None position), slices are FlatLogprobs,
    and it compares equal to the list of dicts it stands for."""

    # Position i's entries are [start_indices[i], end_indices[i]) of the flat lists.
    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position: LogprobsOnePosition | None) -> None:
        self.start_indices.append(len(self.logprobs))
        for token_id, lp in (position or {}).items():
            self.append_entry(token_id, lp.logprob, lp.rank, lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def append_entry(self, token_id: int, logprob: float, rank: int | None, decoded: str | None) -> None:
        """One entry of the position being built (between `start_position` and `end_position`)."""
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        self.decoded_tokens.append(decoded)

    def start_position(self) -> None:
        self.start_indices.append(len(self.logprobs))

    def end_position(self) -> None:
        self.end_indices.append(len(self.logprobs))

    def extend(self, positions: Iterable[LogprobsOnePosition | None]) -> None:
        for position in positions:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> LogprobsOnePosition | FlatLogprobs:
        if isinstance(index, slice):
            starts, ends = self.start_indices[index], self.end_indices[index]
            if not starts:
                return FlatLogprobs()
            lo, hi = starts[0], ends[-1]
            if lo == 0:  # a prefix (CUMULATIVE copies the whole container each output): no rebasing
                return FlatLogprobs(starts, ends, self.token_ids[:hi], self.logprobs[:hi], self.ranks[:hi],
                                    self.decoded_tokens[:hi])
            return FlatLogprobs([i - lo for i in starts], [i - lo for i in ends], self.token_ids[lo:hi],
                                self.logprobs[lo:hi], self.ranks[lo:hi], self.decoded_tokens[lo:hi])
        if not isinstance(index, int):
            raise TypeError(f"Invalid index type: {type(index)}")
        return {self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
                for i in range(self.start_indices[index], self.end_indices[index])}

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value: LogprobsOnePosition | None) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        return (self[i] for i in range(len(self)))

    def __add__(self, other: Iterable[LogprobsOnePosition | None]) -> FlatLogprobs:
        """A new container (DELTA outputs merging in a lagging consumer's queue)."""
        out = self[:]
        out.extend(other)
        return out

    def __radd__(self, other: Iterable[LogprobsOnePosition | None]) -> FlatLogprobs:
        out = FlatLogprobs()
        out.extend(other)
        out.extend(self)
        return out

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FlatLogprobs):
            return (self.start_indices, self.end_indices, self.token_ids, self.logprobs, self.ranks,
                    self.decoded_tokens) == (other.start_indices, other.end_indices, other.token_ids,
                                             other.logprobs, other.ranks, other.decoded_tokens)
        if isinstance(other, Sequence) and not isinstance(other, (str, bytes)):
            return len(self) == len(other) and all(a == (b or {}) for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


# One dict per position: token id -> Logprob (the sampled/prompt token plus the top-k);
# a FlatLogprobs with flat_logprobs=True. The first prompt position is None (nothing precedes it).
SampleLogprobs = FlatLogprobs | list[LogprobsOnePosition]
PromptLogprobs = FlatLogprobs | list[LogprobsOnePosition | None]

_C = TypeVar("_C")


def _keeps_unknown_kwargs(cls: type[_C]) -> type[_C]:
    """Wrap a dataclass __init__ so unknown keyword arguments become attributes."""
    init: Callable[..., None] = cls.__init__  # type: ignore[misc]
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]

    @functools.wraps(init)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        if not kwargs:  # the front-end's per-token path: positional only, nothing to sort
            init(self, *args)
            return
        extra = {k: kwargs.pop(k) for k in [k for k in kwargs if k not in known]}
        init(self, *args, **kwargs)
        for name, value in extra.items():
            setattr(self, name, value)

    cls.__init__ = __init__  # type: ignore[misc]
    return cls


@_keeps_unknown_kwargs
@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReasonStr | None = None
    stop_reason: int | str | None = None
    lora_request = None  # vLLM's field; tidal has no LoRA (a class attribute: no per-token cost)

    def finished(self) -> bool:
        return self.finish_reason is not None


def append_delta(cur: CompletionOutput, nxt: CompletionOutput) -> None:
    """Append a later DELTA completion of the same sequence to `cur`: its text, ids and
    logprobs, and its cumulative logprob and finish. New lists are made, never ones another
    output may share."""
    cur.text += nxt.text
    cur.token_ids = cur.token_ids + nxt.token_ids
    if nxt.logprobs:
        cur.logprobs = (cur.logprobs or []) + nxt.logprobs
    cur.cumulative_logprob = nxt.cumulative_logprob
    cur.finish_reason = nxt.finish_reason
    cur.stop_reason = nxt.stop_reason


@dataclass
class RequestStateStats:
    """Per-request timings, with vLLM V1's names. `arrival_time` is wall-clock (time.time());
    the `*_ts` stamps are the core's time.monotonic() (its events, and the timestamp of the step
    message that carried the tokens, as vLLM V1). Filled only when stats are on
    (disable_log_stats=False)."""

    arrival_time: float = 0.0
    queued_ts: float = 0.0  # the core queued the request
    scheduled_ts: float = 0.0  # first scheduled (admitted to the running batch)
    first_token_ts: float = 0.0  # the step that produced the first generated token
    last_token_ts: float = 0.0  # ... and the latest one
    first_token_latency: float = 0.0  # seconds from arrival to the front-end's receipt of the first token
    num_generation_tokens: int = 0


@_keeps_unknown_kwargs
@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestStateStats | None = None
    # vLLM's fields for features tidal does not have (LoRA, encoder-decoder and multimodal
    # models, disaggregated prefill): class attributes, so reading them works and costs nothing.
    lora_request = None
    encoder_prompt = None
    encoder_prompt_token_ids = None
    multi_modal_placeholders: ClassVar[Mapping[str, Any]] = MappingProxyType({})
    kv_transfer_params = None

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Merge a later output of the same request into this one (vLLM's RequestOutput.add):
        `aggregate` (DELTA) appends text, ids and logprobs per completion index; otherwise the
        later completion replaces the earlier. New lists are made, never ones another output
        may share."""
        self.finished = next_output.finished
        self.num_cached_tokens = next_output.num_cached_tokens
        self.metrics = next_output.metrics
        if next_output.prompt_logprobs is not None:
            self.prompt_logprobs = (self.prompt_logprobs + next_output.prompt_logprobs
                                    if aggregate and self.prompt_logprobs is not None else next_output.prompt_logprobs)
        outputs = self.outputs
        for nxt in next_output.outputs:
            for i, cur in enumerate(outputs):
                if cur.index == nxt.index:
                    if aggregate:
                        append_delta(cur, nxt)
                    else:
                        outputs[i] = nxt
                    break
            else:
                outputs.append(nxt)
                outputs.sort(key=lambda c: c.index)
