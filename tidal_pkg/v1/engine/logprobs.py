"""vLLM's `vllm.v1.engine.logprobs.LogprobsProcessor`, as far as its users and tests touch it:
the per-request logprob state and `_correct_decoded_token`, the replacement-character fix-up.
tidal's output path does the same fix-up in `tidal.frontend.detokenizer` (TokenTexts); this
class runs that one function, so the two cannot drift apart."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tidal.frontend.detokenizer import correct_decoded_token
from tidal.protocol.outputs import PromptLogprobs, SampleLogprobs


@dataclass
class LogprobsProcessor:
    tokenizer: Any
    logprobs: SampleLogprobs | None
    prompt_logprobs: PromptLogprobs | None
    cumulative_logprob: float | None
    num_logprobs: int | None
    num_prompt_logprobs: int | None

    def _correct_decoded_token(self, token_id: int, context_token_ids: Sequence[int]) -> str:
        """The text of `token_id` (whose own decode ends in U+FFFD) after the sampled tokens
        before it, oldest first; "" when no context completes it."""
        return correct_decoded_token(lambda ids: self.tokenizer.decode(ids), token_id, context_token_ids)


__all__ = ["LogprobsProcessor"]
