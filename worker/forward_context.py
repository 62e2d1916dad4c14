"""The forward context: the step's `AttentionMetadata`, set by the model runner around
`model.forward` and read by every `Attention` layer (vLLM's forward context)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tidal.worker.attention_metadata import AttentionMetadata

_forward_context: AttentionMetadata | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata | None) -> Iterator[None]:
    global _forward_context
    prev = _forward_context
    _forward_context = attn_metadata
    try:
        yield
    finally:
        _forward_context = prev


def get_forward_context() -> AttentionMetadata | None:
    return _forward_context
