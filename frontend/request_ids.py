"""Request ids: the one check of a caller's id, and the one scheme of the ids that travel.

A caller's id (vLLM's `request_id`) need not be unique for long: it may be reused as soon as
its request ended, several front-ends may share a headless core, and two HTTP requests may
bring the same `X-Request-Id`. So what is sent on is `<caller's id>#<tag><n>`: `tag` is random
per `RequestIds` (one per front-end or server), `n` counts its ids, so no two in-flight requests
share one, and `external` gives the caller's id back (everything before the last '#', since
the tag and counter hold none; the caller's id may).
"""
from __future__ import annotations

import itertools
import uuid


def check_request_id(request_id: object) -> str:
    """`request_id`, else ValueError: a caller's id must be a non-empty str."""
    if not isinstance(request_id, str) or not request_id:
        raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
    return request_id


def random_request_id() -> str:
    """A fresh id for a request whose caller named none (vLLM's random_uuid)."""
    return uuid.uuid4().hex


class RequestIds:
    """Unique ids for one front-end (or server), made from callers' ids."""

    def __init__(self, tag_chars: int = 8) -> None:
        self.tag = uuid.uuid4().hex[:tag_chars]
        self._count = itertools.count()

    def unique(self, request_id: object) -> str:
        """`request_id` (checked) made unique: `<request_id>#<tag><n>` with a new n."""
        return f"{check_request_id(request_id)}#{self.tag}{next(self._count):x}"

    def fixed(self, request_id: object) -> str:
        """`request_id` (checked) as `<request_id>#<tag>`, the same each time: for a caller
        that keeps its ids unique among its running requests itself (LLMEngine refuses an id
        still running), so the sent id can be found again from the caller's (to abort it)."""
        return f"{check_request_id(request_id)}#{self.tag}"

    @staticmethod
    def external(unique_id: str) -> str:
        """The caller's id of a `unique` id."""
        return unique_id.rpartition("#")[0]
