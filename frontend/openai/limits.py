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

from tidal.frontend.openai.errors import APIError
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

    def check(self, num_prompts: int, n: object, stop: object, bad_words: object) -> None:
        """400 naming the field and the limit when a request asks for more than these."""
        if num_prompts > self.max_prompts:
            raise APIError(f"at most {self.max_prompts} prompts per request (TIDAL_MAX_COMPLETION_PROMPTS), "
                           f"got {num_prompts}", HTTPStatus.BAD_REQUEST, "prompt")
        if isinstance(n, int) and num_prompts * n > self.max_sequences:
            raise APIError(f"prompts x n must be at most {self.max_sequences} (TIDAL_MAX_N_SEQUENCES), got "
                           f"{num_prompts} x {n}", HTTPStatus.BAD_REQUEST, "n")
        if isinstance(stop, list) and len(stop) > self.max_stop_strings:
            raise APIError(f"at most {self.max_stop_strings} stop strings (TIDAL_MAX_STOP_STRINGS), got "
                           f"{len(stop)}", HTTPStatus.BAD_REQUEST, "stop")
        if isinstance(bad_words, list) and len(bad_words) > self.max_bad_words:
            raise APIError(f"at most {self.max_bad_words} bad_words (TIDAL_MAX_NUM_BAD_WORDS), got "
                           f"{len(bad_words)}", HTTPStatus.BAD_REQUEST, "bad_words")
