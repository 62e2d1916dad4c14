"""Per-request state kept by the engine core's scheduler (vLLM V1's `Request`).

Invariants:
- `all_token_ids == prompt_token_ids + output_token_ids` at all times; only
  `append_output_token_ids` grows them.
- `0 <= num_computed_tokens <= num_tokens`: tokens whose KV is in the request's blocks.
- `block_hashes` holds the hash chain of a prefix of the request's *full* blocks; the KV cache
  manager extends it lazily (it owns the block size), it never shrinks.
- Facts about a request live on it, not in side maps keyed by its id: who sent it
  (`client_index`), its `priority`, and how many prompt-logprob rows were sent, so nothing is
  left to clean up when it ends.
- `sort_key` = (priority, arrival_time, creation order) is unique per request and fixed for its
  life: the priority policy's admission order (ascending) and preemption order (descending).
"""
from __future__ import annotations

import enum
import itertools
import time
from typing import TYPE_CHECKING

from tidal.protocol.messages import EngineCoreEventType, EngineCoreRequest, FinishReason
from tidal.protocol.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tidal.core.structured_output import StructuredOutputRequest

# (EngineCoreEventType value, time.monotonic()) as carried by `EngineCoreOutput.events`.
EngineCoreEvent = tuple[int, float]
# The front-end a request came from, where its outputs go (vLLM's client_index): the ZMQ
# identity of its socket in the core process, None for a caller in this process.
ClientIndex = bytes | None
# Creation order of requests in this process: the last tie-breaker of `Request.sort_key`.
_creation_counter = itertools.count()


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    # Queued like WAITING, but its structured-output grammar is still compiling: the scheduler
    # passes over it (vLLM's WAITING_FOR_FSM).
    WAITING_FOR_GRAMMAR = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is a finished state (see `is_finished`).
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    def __str__(self) -> str:
        return self.name

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        *,
        max_model_len: int | None = None,
        client_index: ClientIndex = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id: str = request_id
        self.client_index: ClientIndex = client_index
        self.priority: int = priority  # scheduling_policy="priority": lower runs first
        self.prompt_token_ids: list[int] = prompt_token_ids  # never mutated
        self.sampling_params: SamplingParams = sampling_params
        self.eos_token_id: int | None = eos_token_id
        self.arrival_time: float = time.time() if arrival_time is None else arrival_time
        self.sort_key: tuple[int, float, int] = (priority, self.arrival_time, next(_creation_counter))

        if sampling_params.max_tokens is not None:
            self.max_tokens: int = sampling_params.max_tokens
        elif max_model_len is not None:
            self.max_tokens = max_model_len - len(prompt_token_ids)
        else:
            raise ValueError("max_tokens is None: max_model_len is needed to resolve it.")
        self.stop_token_ids: frozenset[int] = frozenset(sampling_params.stop_token_ids or ())

        self.status: RequestStatus = RequestStatus.WAITING
        # Grammar state of a structured-output request (core/structured_output.py), else None.
        self.structured_output_request: StructuredOutputRequest | None = None
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens: int = 0
        self.num_cached_tokens: int = -1  # prefix-cache hit of the first admission; -1 before
        self.block_hashes: list[int] = []
        self.cache_salt: str | None = cache_salt  # the first block's hash includes it
        # How many of `all_token_ids` the model runner holds (0: it holds no state for us).
        # The scheduler sends `all_token_ids[num_synced_tokens:]` as the next delta.
        self.num_synced_tokens: int = 0
        # Blocks dropped from the tail of its table (they held only rejected speculative rows)
        # since the runner last saw it; sent with the next CachedRequestData, then 0.
        self.num_dropped_blocks: int = 0
        # Speculative decoding's adaptive proposal count (core/spec_decode.SpecDecoder): the
        # most proposals its next step gets (None: the configured k), the steps it sits out
        # after drafts of which nothing was accepted, and how long the next sit-out is.
        self.spec_k: int | None = None
        self.spec_misses: int = 0
        self.spec_skip: int = 0
        self.spec_backoff: int = 0
        # Prompt-logprob rows already sent: a request preempted mid-prefill recomputes its
        # prompt, and those rows must not reach the user twice.
        self.num_prompt_logprobs_sent: int = 0
        self.events: list[EngineCoreEvent] = []  # recorded only when stats are on
        # Suspected of a crash: runs only in a step of its own until its first token (see
        # core/quarantine.py); the scheduler lifts it then.
        self.quarantined: bool = False
        # The front-end was told this core started it (EngineCore announces each request once,
        # before the forward pass of its first step): its crash rule blames only requests that ran.
        self.announced: bool = False

    @classmethod
    def from_engine_core_request(cls, req: EngineCoreRequest, max_model_len: int,
                                 client_index: ClientIndex = None) -> "Request":
        request = cls(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            eos_token_id=req.eos_token_id,
            arrival_time=req.arrival_time,
            max_model_len=max_model_len,
            client_index=client_index,
            cache_salt=req.cache_salt,
            priority=req.priority,
        )
        if req.resumed_output_token_ids:  # resumed after a core restart: as if preempted
            request.append_output_token_ids(list(req.resumed_output_token_ids))
        request.num_prompt_logprobs_sent = req.num_prompt_logprobs_sent
        request.quarantined = req.quarantined
        return request

    # ------------------------------------------------------------------ tokens

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            self.output_token_ids.append(token_ids)
            self.all_token_ids.append(token_ids)
        else:
            self.output_token_ids.extend(token_ids)
            self.all_token_ids.extend(token_ids)

    # ------------------------------------------------------------------ status

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    # ------------------------------------------------------------------ events

    def record_event(self, event_type: EngineCoreEventType, timestamp: float | None = None) -> None:
        """Events carry `time.monotonic()` stamps (as vLLM's)."""
        self.events.append((int(event_type), time.monotonic() if timestamp is None else timestamp))

    def take_events(self) -> list[EngineCoreEvent] | None:
        if not self.events:
            return None
        events, self.events = self.events, []
        return events

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, out={self.num_output_tokens})"
        )
