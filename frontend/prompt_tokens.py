"""Text prompts to token ids, one way for every entry point: `InputProcessor` (LLM, AsyncLLM)
and the OpenAI server (which must know a prompt's length before it builds the request) both
tokenize, truncate and size-check here, so the two cannot drift apart again.

- `truncation_length`: vLLM's rule for `truncate_prompt_tokens` and its messages (and, for the
  OpenAI server, its `truncation_side`: which end of the prompt is kept).
- `PromptEncoder`: the tokenizer's encode (the Rust encoder directly where it agrees), a text
  that cannot fit refused untokenized, truncation.
- `off_loop_if_long`: work on a long text runs in a worker thread, so an event loop keeps serving.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tidal.frontend.detokenizer import rust_backend
from tidal.frontend.tokenizer import LONG_TEXT_CHARS, check_prompt_chars, prompt_char_limit, rust_encode

T = TypeVar("T")
_PROBE_TEXT = "Hello world! 你好 😀 \n  def f(x): return x"


class KeepFirst(int):
    """A `truncation_length` that keeps a prompt's first tokens rather than its last (vLLM's
    `truncation_side: "right"`): an int, so every bound and comparison reads it as the count."""

    __slots__ = ()


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int,
                      truncation_side: str | None = None) -> int | None:
    """The prompt tokens `truncate_prompt_tokens` keeps: None (no truncation), -1
    (max_model_len) or 1..max_model_len, else ValueError in vLLM's words (SamplingParams'
    for 0 and below -1; `_validate_truncation_size`'s above max_model_len). Checked before
    tokenizing, so a bad value costs nothing. Its last tokens are kept, as vLLM's generation
    tokenizers truncate ("left", also for None); `truncation_side="right"` (the OpenAI server's
    request field) keeps the first: a KeepFirst."""
    if truncation_side not in (None, "left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
    keep = truncate_prompt_tokens
    if keep is None:
        return None
    if keep == -1:
        keep = max_model_len
    elif keep < 1:
        raise ValueError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {keep}")
    elif keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len})."
                         f" Please, select a smaller truncation size.")
    return KeepFirst(keep) if truncation_side == "right" else keep


def keep_last(ids: list[int], keep: int | None) -> list[int]:
    """`ids` truncated to `keep` tokens (a `truncation_length`; None keeps all): their last,
    or their first when `keep` is a KeepFirst (truncation_side "right")."""
    if keep is None or len(ids) <= keep:
        return ids
    return ids[:keep] if isinstance(keep, KeepFirst) else ids[-keep:]


async def off_loop_if_long(chars: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), in a worker thread when it works on more than LONG_TEXT_CHARS characters of
    text (tokenizing megabytes takes seconds: on the loop it would stall every other stream),
    else right here (a thread hop costs more than tokenizing a short text)."""
    if chars > LONG_TEXT_CHARS:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class PromptEncoder:
    """Token ids of text prompts for one tokenizer and context window."""

    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer, self.max_model_len = tokenizer, max_model_len
        self.tokenize: Callable[[str, bool], list[int]] = self._tokenizer_encode
        # The Rust encoder directly when it agrees with the tokenizer's own encode: faster, and
        # it releases the GIL on long texts (rust_encode), so a worker thread encoding one does
        # not stall the loop.
        backend = rust_backend(tokenizer)
        if backend is not None and tokenizer is not backend:
            try:
                if backend.encode(_PROBE_TEXT).ids == list(tokenizer.encode(_PROBE_TEXT)):
                    self.tokenize = lambda text, special=True: rust_encode(backend, text, special)
            except Exception:  # a tokenizer whose encode differs in kind: keep its own
                pass
        elif backend is not None:
            self.tokenize = lambda text, special=True: rust_encode(backend, text, special)
        self._char_limit: int | None = None
        self._lock = threading.Lock()

    def _tokenizer_encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def char_limit(self) -> int:
        """prompt_char_limit, computed once (a pass over the vocabulary): on first need, or at
        start-up by a caller that wants none of it on a request's path."""
        with self._lock:
            if self._char_limit is None:
                self._char_limit = prompt_char_limit(self.tokenizer, self.max_model_len)
            return self._char_limit

    def check_fits(self, text: str) -> None:
        """ValueError, untokenized, for a text prompt longer than any that fits max_model_len
        tokens (only long texts are measured: a short one tokenizes faster than the check)."""
        if len(text) > LONG_TEXT_CHARS:
            check_prompt_chars(len(text), self.char_limit(), self.max_model_len)

    def encode(self, text: str, add_special_tokens: bool = True, keep: int | None = None,
               check_fit: bool = True) -> list[int]:
        """Token ids of `text`, truncated to `keep` (a `truncation_length`: its last tokens, or
        its first for a KeepFirst) if given. A text that cannot fit is refused before
        tokenizing (check_fits), unless it is truncated (a part of it is what is asked for) or
        `check_fit` is off (counting tokens, as /tokenize does)."""
        if check_fit and keep is None:
            self.check_fits(text)
        return keep_last(list(self.tokenize(text, add_special_tokens)), keep)

    async def encode_async(self, text: str, add_special_tokens: bool = True, keep: int | None = None,
                           check_fit: bool = True) -> list[int]:
        """`encode`, a long text in a worker thread (off_loop_if_long)."""
        return await off_loop_if_long(len(text), self.encode, text, add_special_tokens, keep, check_fit)
