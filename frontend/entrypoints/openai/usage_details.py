"""usage.prompt_tokens_details (vLLM's --enable-prompt-tokens-details): `cached_tokens`, the
prompt tokens served from the prefix cache (RequestOutput.num_cached_tokens), in chat and
completions usage, streamed and not.

How vLLM renders it, and so this server (vllm/entrypoints/openai/chat_completion/serving.py,
completion/serving.py and their api_router.py):
- a whole (non-streamed) response is `model_dump()`ed: `"prompt_tokens_details": null` without
  the flag, `{"cached_tokens": N}` with it (0 included: vLLM tests `is not None`);
- a stream's closing usage chunk is dumped with `exclude_none`: the field is absent without the
  flag; with it, the chunk carries it;
- the per-chunk usage of `continuous_usage_stats` never carries it (`exclude_unset`: absent).
A request with several prompts reports the sum over its prompts, as prompt_tokens is a sum (vLLM
reports one prompt's count there: the last one's whole, the first one's streamed).

Streams keep sse.py's framing; `DetailsFraming` only changes how usage is encoded in them, with
a usage struct that leaves `prompt_tokens_details` out when it is None.
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
from tidal.frontend.entrypoints.openai.protocol import PromptTokenUsageInfo, UsageInfo
from tidal.frontend.entrypoints.openai.sse import StreamFraming, sse

_encode = msgspec.json.encode


class StreamUsage(msgspec.Struct, omit_defaults=True):
    """A stream's usage: the counts always, the details only when set (vLLM's exclude_none)."""

    prompt_tokens: int
    total_tokens: int
    completion_tokens: int
    prompt_tokens_details: PromptTokenUsageInfo | None = None


class StreamUsageChunk(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[Any]
    usage: StreamUsage


def cached_details(enabled: bool, num_cached_tokens: int) -> PromptTokenUsageInfo | None:
    """The usage's prompt_tokens_details: None unless the server reports them."""
    return PromptTokenUsageInfo(cached_tokens=num_cached_tokens) if enabled else None


class CachedTokens:
    """The prefix-cache hits of a request's prompts (prompt index -> the latest count seen), for
    a stream's closing usage; nothing is kept unless the server reports them."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.by_prompt: dict[int, int] = {}

    def see(self, prompt_index: int, num_cached_tokens: int, usage: UsageInfo) -> None:
        if self.enabled:
            self.by_prompt[prompt_index] = num_cached_tokens
            usage.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=sum(self.by_prompt.values()))


class DetailsFraming(StreamFraming):
    """sse.StreamFraming whose usage (per chunk with continuous_usage_stats, and the closing
    usage chunk) leaves prompt_tokens_details out unless set, and whose closing chunk carries
    the details the handler set on the stream's UsageInfo."""

    def tail(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        if not self.continuous:
            return self.suffix
        usage = StreamUsage(prompt_tokens, prompt_tokens + completion_tokens, completion_tokens)
        return b'],"usage":' + _encode(usage) + b"}\n\n"

    def usage_chunk(self, usage: UsageInfo) -> bytes:
        total = StreamUsage(usage.prompt_tokens, usage.prompt_tokens + usage.completion_tokens,
                            usage.completion_tokens, usage.prompt_tokens_details)
        return sse(StreamUsageChunk(self.request_id, self.obj, int(time.time()), self.model, [], total))
