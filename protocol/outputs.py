"""User-facing outputs, with vLLM's names and fields."""
from __future__ import annotations

from dataclasses import dataclass

FinishReasonStr = str  # "stop" | "length" | "abort" | "error"


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the sampled/prompt token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: FinishReasonStr | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """Per-request timings, with vLLM V1's names. `arrival_time` is wall-clock (time.time());
    the `*_ts` stamps are time.monotonic() (the core's events and the front-end's receipt of
    tokens, one clock on one host). Filled only when stats are on (disable_log_stats=False)."""

    arrival_time: float = 0.0
    queued_ts: float = 0.0  # the core queued the request
    scheduled_ts: float = 0.0  # first scheduled (admitted to the running batch)
    first_token_ts: float = 0.0  # the front-end received the first generated token
    last_token_ts: float = 0.0  # ... and the latest one
    first_token_latency: float = 0.0  # seconds from arrival to the first token
    num_generation_tokens: int = 0


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
