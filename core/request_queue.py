"""The scheduler's waiting queue, one class per `scheduling_policy` (vLLM V1's request_queue).

Invariants:
- A queue holds each request at most once; `pop_request`/`peek_request` give the request the
  policy admits next.
- FCFS: arrival order into the scheduler; `prepend_request` (a preempted request) puts it first.
- PRIORITY: ascending `Request.sort_key` = (priority, arrival_time, creation order): lower
  priority value first, then earlier arrival. `prepend_request` is `add_request`: a preempted
  request goes back at its own rank, there is no "front" to jump to (as vLLM).
"""
from __future__ import annotations

import enum
import heapq
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Iterable, Iterator

from tidal.core.request import Request


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class RequestQueue(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def pop_request(self) -> Request: ...

    @abstractmethod
    def peek_request(self) -> Request: ...

    @abstractmethod
    def prepend_request(self, request: Request) -> None:
        """Put back a preempted request, where the policy resumes it."""

    @abstractmethod
    def remove_requests(self, requests: Iterable[Request]) -> None:
        """Drop these requests (each must be queued): one O(n) pass however many."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Request]:
        """In the order the policy would admit them."""

    def __bool__(self) -> bool:
        return len(self) > 0

    def __contains__(self, request: object) -> bool:
        return any(r is request for r in self)


class FCFSRequestQueue(RequestQueue):
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add_request(self, request: Request) -> None:
        self._queue.append(request)

    def pop_request(self) -> Request:
        return self._queue.popleft()

    def peek_request(self) -> Request:
        return self._queue[0]

    def prepend_request(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._queue = deque(r for r in self._queue if id(r) not in drop)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityRequestQueue(RequestQueue):
    """A heap of (sort_key, request); sort keys are unique, so requests are never compared."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, float, int], Request]] = []

    def add_request(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.sort_key, request))

    def pop_request(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def peek_request(self) -> Request:
        return self._heap[0][1]

    def prepend_request(self, request: Request) -> None:
        self.add_request(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        drop = {id(r) for r in requests}
        self._heap = [e for e in self._heap if id(e[1]) not in drop]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return (r for _, r in sorted(self._heap, key=lambda e: e[0]))


def create_request_queue(policy: SchedulingPolicy | str) -> RequestQueue:
    policy = SchedulingPolicy(policy)  # ValueError for an unknown name
    return PriorityRequestQueue() if policy == SchedulingPolicy.PRIORITY else FCFSRequestQueue()
