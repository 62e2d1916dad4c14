"""Wire structs between the front-end, the engine core and the workers.

All are msgspec Structs with `array_like=True, omit_defaults=True, gc=False`; new fields go
last, with defaults, so old peers still decode new messages. numpy arrays inside them travel as
extra zero-copy frames (see `codec`).
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec
import numpy as np

from tidal.protocol.config import ResolvedEngineInfo
from tidal.protocol.sampling_params import SamplingParams

_STRUCT = dict(array_like=True, omit_defaults=True, gc=False)


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class ErrorKind(enum.IntEnum):
    """What an ERROR output means to the front-end (`EngineCoreOutput.error_kind`)."""

    REQUEST = 0  # this request failed (EngineGenerateError); the engine serves on
    # Refused at admission, nothing queued: waiting queue full or core draining. Retrying
    # later may succeed (EngineOverloadedError; HTTP 503 with Retry-After).
    OVERLOADED = 1
    # The core refused the request as invalid (a rule the front-end could not check, such as a
    # grammar that does not compile): InvalidRequestError, a ValueError; HTTP 400.
    INVALID = 2


class EngineCoreRequestType(bytes, enum.Enum):
    """First frame of every front-end -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"


# A front-end's first call: the utility the core process itself answers, with its
# ResolvedEngineInfo or its start-up error (EngineCore has no such method).
HELLO = "hello"


class EngineCoreRequest(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0  # scheduling_policy="priority": lower runs first (vLLM's convention)
    # A request resumed on a restarted core (front-end fault tolerance): the tokens it had
    # generated before the crash. The core takes them as outputs already sampled (as after a
    # preemption), so its budget, penalties, seeds (a pure function of position) and stop
    # checks go on exactly where they were.
    resumed_output_token_ids: list[int] = []
    num_prompt_logprobs_sent: int = 0  # prompt-logprob rows the front-end has (not sent again)
    # A resumed request suspected of a crash (it was in the step that failed): the scheduler
    # runs it only in a step of its own until it produces a token, so that a crash while it
    # runs proves it guilty and never blames the requests it would have shared a step with
    # (see core/quarantine.py, frontend/recovery.py triage).
    quarantined: bool = False
    # vLLM's prompt `cache_salt`: mixed into the hash of the first block, so only requests with
    # the same salt share prefix-cache blocks (tenants cannot probe each other's prompts).
    cache_salt: str | None = None
    # vLLM's: the data-parallel engine this request must run on (None: the front-end picks).
    data_parallel_rank: int | None = None


# An argument of a utility call: scalars only (no utility takes a container), so that an
# argument list cannot nest.
UtilityArg = str | int | float | bool | None


class UtilityRequest(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    call_id: int
    method: str
    args: list[UtilityArg] = []


_NIL = msgspec.Raw(b"\xc0")  # msgpack nil


class UtilityOutput(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    call_id: int
    # The method's result, msgpack-encoded; decoded with UTILITY_RESULT_TYPES[method] by the
    # caller, the only side that knows which method it called (see `encode_utility_result`).
    result: msgspec.Raw = _NIL
    failure: str | None = None


class LogprobsArrays(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """Logprobs of N positions. Column 0 holds the chosen (sampled or prompt) token; columns
    1..k the top-k in rank order. `ranks` is the rank (1-based) of the chosen token."""

    token_ids: np.ndarray  # [N, k+1] int32
    logprobs: np.ndarray  # [N, k+1] float32
    ranks: np.ndarray  # [N] int32

    @staticmethod
    def concat(parts: list["LogprobsArrays"]) -> "LogprobsArrays":
        if len(parts) == 1:
            return parts[0]
        return LogprobsArrays(
            np.concatenate([p.token_ids for p in parts]),
            np.concatenate([p.logprobs for p in parts]),
            np.concatenate([p.ranks for p in parts]),
        )


class EngineCoreEventType(enum.IntEnum):
    QUEUED = 1
    SCHEDULED = 2
    PREEMPTED = 3


class EngineCoreOutput(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: LogprobsArrays | None = None
    new_prompt_logprobs: LogprobsArrays | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    events: list[tuple[int, float]] | None = None
    error: str | None = None  # with finish_reason ERROR: what went wrong for this request
    error_kind: ErrorKind = ErrorKind.REQUEST  # with finish_reason ERROR: see ErrorKind

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens looked up (cumulative)
    prefix_cache_hits: int = 0  # tokens found (cumulative)
    num_preemptions: int = 0  # cumulative
    num_prompt_tokens: int = 0  # cumulative prompt tokens computed
    num_generation_tokens: int = 0  # cumulative tokens generated
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_batched_tokens: int = 0  # this step
    num_scheduled_seqs: int = 0  # this step
    # Speculative decoding (vLLM's SpecDecodingStats names), cumulative: requests given proposals
    # (one draft per request per step), proposals made, proposals accepted, and how often the
    # proposal at each position (0..num_speculative_tokens-1) was accepted.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []


# What each utility the engine core answers returns, so that a result is decoded precisely.
UTILITY_RESULT_TYPES: dict[str, Any] = {
    HELLO: ResolvedEngineInfo,
    "get_stats": SchedulerStats,
    "reset_prefix_cache": bool,
    "get_timing": tuple[float, float, int],  # cumulative (step seconds, forward seconds, steps)
}


def encode_utility_result(result: object) -> msgspec.Raw:
    return msgspec.Raw(msgspec.msgpack.encode(result))


def decode_utility_result(method: str, result: msgspec.Raw) -> Any:
    """ValueError for a method without a declared result type, msgspec errors for a result
    that does not match it."""
    type_ = UTILITY_RESULT_TYPES.get(method)
    if type_ is None:
        raise ValueError(f"utility {method!r} has no declared result type")
    return msgspec.msgpack.decode(result, type=type_)


class EngineCoreOutputs(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    engine_dead: str | None = None  # set once, on the last message of a dying core
    # With engine_dead: this front-end's requests (its ids) that were in the step that failed;
    # [] when none of its requests were (or the core stopped on purpose), None when unknown
    # (no step was running, or the message did not say).
    failed_step_request_ids: list[str] | None = None
    engine_index: int = 0  # vLLM's: the data-parallel rank of the core that sent it


# ---------------------------------------------------------------- core -> workers


class WorkerFrame:
    """Frame 0 of core <-> worker-process messages (frame 1 of a worker's reply: its rank)."""

    STEP = b"S"  # core -> worker: an encoded SchedulerOutput follows
    SHUTDOWN = b"Q"  # core -> worker
    READY = b"R"  # worker -> core: an encoded ResolvedEngineInfo follows
    OUTPUT = b"O"  # rank 0 -> core: an encoded ModelRunnerOutput follows
    FAILED = b"F"  # any rank -> core: utf-8 text naming the cause
    WHERE = b"W"  # rank -> core, answering a probe: [WHERE, rank, busy step (0: idle), stack, flag]
    IN_COLLECTIVE = b"c"  # optional last frame of FAILED/WHERE: raised in / blocked in torch.distributed


class NewRequestData(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """A request the runner has not seen (or sees again after preemption), in full."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = []  # generated before a preemption; recomputed now
    eos_token_id: int | None = None  # the sampler forbids it (and stop ids) before min_tokens


class CachedRequestData(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    """A running request the runner already holds: only what changed since its last step."""

    req_id: str
    new_token_ids: list[int]  # tokens appended to the request since the runner last saw it
    new_block_ids: list[int]
    num_computed_tokens: int
    # Blocks dropped from the tail of its table since the runner last saw it (they held only
    # rejected speculative rows), removed before new_block_ids are appended.
    num_dropped_blocks: int = 0


class SchedulerOutput(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: list[CachedRequestData] = []
    # req_id -> tokens computed this step; a request samples iff its chunk reaches its last token
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    # Requests whose runner state must be dropped (finished, aborted or preempted) before this step.
    finished_req_ids: list[str] = []
    # Structured outputs: the constrained requests that sample this step, and row i of
    # `grammar_bitmask` [len(ids) + proposals, ceil(vocab / 32)] int32 is the packed set of
    # tokens request ids[i] may sample (bit t % 32 of word t // 32). Unconstrained rows are not
    # in it. After those rows come one per speculative proposal of each constrained request,
    # request by request in ids order: the mask after the proposals before it
    # (worker/spec_decode.py grammar_proposal_rows reads this layout).
    structured_output_request_ids: list[str] = []
    grammar_bitmask: np.ndarray | None = None
    # Speculative decoding (vLLM's name): req_id -> the tokens proposed after its last one. Such a
    # request's num_scheduled_tokens counts its tokens to compute plus these; it samples every
    # row from its last token on and returns the tokens up to the first that differs from its
    # proposal (all of them and one more when none does): see core/spec_decode.py.
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}


class ModelRunnerOutput(msgspec.Struct, **_STRUCT):  # type: ignore[call-arg]
    req_ids: list[str] = []  # the scheduled requests, in the runner's batch order
    # Per request: [] when its chunk stopped short of the prompt's end, else the new token (with
    # speculative proposals: the accepted ones and the target's next token, in order).
    sampled_token_ids: list[list[int]] = []
    logprobs: dict[str, LogprobsArrays] = {}
    prompt_logprobs: dict[str, LogprobsArrays] = {}
    # Wall seconds the model forward took (the engine reports its own overhead beside it).
    forward_time_s: float = 0.0
    # Requests whose sampling or prompt logprobs failed this step (found by retrying the
    # batch's rows apart), req_id -> error summary: the core fails each alone; the others'
    # results stand.
    failed_req_ids: dict[str, str] = {}
    # Those of failed_req_ids that the request's own settings explain (its masks left no token
    # to sample): failed as invalid (InvalidRequestError, HTTP 400), not as the engine's fault.
    invalid_req_ids: list[str] = []


# ---------------------------------------------------------------- data-parallel hosts -> head


class EngineHello(msgspec.Struct):
    """A host of data-parallel engines registers them with the head (core/dp_node.py ->
    frontend/dp_remote.py), as JSON."""

    start_rank: int
    addresses: list[str]  # the engines of ranks start_rank, start_rank + 1, ...
    data_parallel_size: int
    model: str


class HelloReply(msgspec.Struct):
    error: str | None = None  # why the head refused the registration
