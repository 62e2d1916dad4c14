"""Beam search's user-facing types and scoring, with vLLM's names (vllm/beam_search.py and
`vllm.sampling_params.BeamSearchParams`). The search itself runs on top of the engine, in the
front-end (tidal.frontend.beam_search).

Invariants:
- `BeamSearchSequence.tokens` holds the prompt *and* the generated tokens (as vLLM's), so the
  length penalty divides by the whole length, less one for a final EOS.
- `logprobs[i]` is the engine's logprob dict of the step that chose generated token i.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tidal.protocol.outputs import Logprob


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's fields and defaults. `temperature` 0 is greedy: every step ranks the 2 *
    beam_width most likely next tokens of each beam; > 0 samples one more candidate."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be an int >= 1, got {self.beam_width!r}.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")


@dataclass
class BeamSearchSequence:
    """One beam: the prompt's tokens then the generated ones, their cumulative logprob; `text`
    (the decoded `tokens`, prompt included, as vLLM) is filled once the beam is returned."""

    orig_prompt: dict[str, Any]
    tokens: list[int]
    logprobs: list[dict[int, Logprob]]
    lora_request: None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` (at most) sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence] = field(default_factory=list)


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: int | None,
                          length_penalty: float = 1.0) -> float:
    """cumulative_logprob / length ** length_penalty, the length not counting a final EOS
    (transformers' and vLLM's beam score)."""
    seq_len = len(tokens)
    if tokens and tokens[-1] == eos_token_id:
        seq_len -= 1
    return cumulative_logprob / (seq_len**length_penalty)


def create_sort_beams_key_function(eos_token_id: int | None,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key
