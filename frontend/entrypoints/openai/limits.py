"""How much one HTTP request may ask for, checked before any of it is tokenized or queued.

Each prompt, each of its n samples and each stop string or bad word costs the front-end (and
the core) work per request or per token; without a bound, one request within the body limit
(100,000 prompts, 100,000 stop strings) stalled every other stream for tens of seconds. The
limits and their defaults are vLLM's (VLLM_MAX_N_SEQUENCES, VLLM_MAX_COMPLETION_PROMPTS,
VLLM_MAX_STOP_STRINGS, VLLM_MAX_NUM_BAD_WORDS) under TIDAL_ names (protocol/envs.py), read
once when the server starts. n alone is SamplingParams' own check, for LLM users too.
"""
from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus

from tidal.frontend.entrypoints.openai.errors import APIError
from tidal.frontend.entrypoints.openai.protocol import SamplingFields
from tidal.protocol import envs


@dataclass(frozen=True)
class RequestSizeLimits:
    max_prompts: int = 1024  # prompts in one /v1/completions request
    max_sequences: int = 16384  # prompts x n
    max_stop_strings: int = 4  # OpenAI documents "up to 4"
    max_bad_words: int = 128

    @classmethod
    def from_env(cls) -> RequestSizeLimits:
        """The limits in force (ValueError naming a malformed variable)."""
        return cls(envs.TIDAL_MAX_COMPLETION_PROMPTS, envs.TIDAL_MAX_N_SEQUENCES, envs.TIDAL_MAX_STOP_STRINGS,
                   envs.TIDAL_MAX_NUM_BAD_WORDS)

    def check(self, num_prompts: int, req: SamplingFields, vocab_size: int) -> None:
        """400 naming the field and the limit when a request asks for more than these. Token-id
        collections longer than the vocabulary (which must repeat or leave it) are refused too:
        2,000,000 logit_bias entries took 17 s to check, stalling every stream meanwhile."""
        if num_prompts > self.max_prompts:
            raise APIError(f"at most {self.max_prompts} prompts per request (TIDAL_MAX_COMPLETION_PROMPTS), "
                           f"got {num_prompts}", HTTPStatus.BAD_REQUEST, "prompt")
        if isinstance(req.n, int) and num_prompts * req.n > self.max_sequences:
            raise APIError(f"prompts x n must be at most {self.max_sequences} (TIDAL_MAX_N_SEQUENCES), got "
                           f"{num_prompts} x {req.n}", HTTPStatus.BAD_REQUEST, "n")
        if isinstance(req.stop, list) and len(req.stop) > self.max_stop_strings:
            raise APIError(f"at most {self.max_stop_strings} stop strings (TIDAL_MAX_STOP_STRINGS), got "
                           f"{len(req.stop)}", HTTPStatus.BAD_REQUEST, "stop")
        if req.bad_words is not None and len(req.bad_words) > self.max_bad_words:
            raise APIError(f"at most {self.max_bad_words} bad_words (TIDAL_MAX_NUM_BAD_WORDS), got "
                           f"{len(req.bad_words)}", HTTPStatus.BAD_REQUEST, "bad_words")
        for name in ("logit_bias", "allowed_token_ids", "stop_token_ids"):
            ids = getattr(req, name)
            if ids is not None and len(ids) > vocab_size:
                raise APIError(f"{name} has {len(ids)} entries, more than the vocabulary's {vocab_size} tokens",
                               HTTPStatus.BAD_REQUEST, name)
