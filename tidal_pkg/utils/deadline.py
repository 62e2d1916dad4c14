"""`Deadline`: the point in time every bounded wait polls against."""
from __future__ import annotations

import time


class Deadline:
    """A point in time.monotonic(); every bounded wait loop polls in slices against one."""

    __slots__ = ("at",)

    def __init__(self, timeout_s: float) -> None:
        self.at = time.monotonic() + timeout_s

    def remaining_s(self) -> float:
        return max(0.0, self.at - time.monotonic())

    def remaining_ms(self, cap_ms: int) -> int:
        """The next poll slice: at most `cap_ms`, never past the deadline."""
        return max(0, min(cap_ms, int(self.remaining_s() * 1000)))

    def expired(self) -> bool:
        return time.monotonic() >= self.at
