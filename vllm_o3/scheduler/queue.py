"""The waiting queue: strict tier order, earliest deadline first within a tier,
then vLLM's integer `priority`, then arrival; tiers at their concurrency cap
are passed over.

It replaces vLLM's waiting queue inside the scheduler, so vLLM's own admission
loop (prefix caching, chunked prefill, KV allocation) takes requests in O3's
order. One heap per tier keeps peek and pop O(log n) with thousands waiting.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from vllm.v1.core.sched.request_queue import RequestQueue
from vllm.v1.request import Request

from vllm_o3.scheduler.tiers import Tier


@dataclass
class Placement:
    """Where a request stands: the tier it is served as, its absolute deadline
    (wall-clock seconds, None for no deadline) and the tier it asked for."""

    tier: Tier
    deadline: float | None
    asked: Tier
    trial: bool = False  # the breaker's half-open trial request
    scheduled: bool = False  # reached the running set at least once

    def sort_key(self, request: Request) -> tuple:
        deadline = math.inf if self.deadline is None else self.deadline
        return (deadline, request.priority, request.arrival_time)


def placement(request: Request) -> Placement:
    return request.o3_placement  # set by O3Scheduler.add_request


class TierQueue(RequestQueue):
    """`len()` counts every waiting request; truth means "one can be admitted
    now" (a request whose tier is under its cap), which is what vLLM's
    admission loop asks."""

    def __init__(self, caps: dict[Tier, int | None]):
        self.caps = caps
        self.running = dict.fromkeys(Tier, 0)
        self._heaps: dict[Tier, list[list]] = {tier: [] for tier in Tier}
        self._entries: dict[Request, list] = {}
        self._dead = 0
        self._sequence = itertools.count()

    def set_running(self, running: Iterable[Request]) -> None:
        """Start a scheduling step with the running set's tier counts."""
        self.running = dict.fromkeys(Tier, 0)
        for request in running:
            self.running[placement(request).tier] += 1

    def _head(self, tier: Tier) -> Request | None:
        heap = self._heaps[tier]
        while heap and heap[0][-1] is None:
            heapq.heappop(heap)
            self._dead -= 1
        return heap[0][-1] if heap else None

    def _admissible(self) -> Request | None:
        for tier in Tier:
            cap = self.caps[tier]
            if cap is not None and self.running[tier] >= cap:
                continue
            head = self._head(tier)
            if head is not None:
                return head
        return None

    def add_request(self, request: Request) -> None:
        where = placement(request)
        entry = [*where.sort_key(request), next(self._sequence), request]
        self._entries[request] = entry
        heapq.heappush(self._heaps[where.tier], entry)

    def pop_request(self) -> Request:
        request = self._admissible()
        if request is None:
            raise IndexError("no waiting request can be admitted")
        self._discard(request)
        self.running[placement(request).tier] += 1
        return request

    def peek_request(self) -> Request:
        request = self._admissible()
        if request is None:
            raise IndexError("no waiting request can be admitted")
        return request

    def prepend_request(self, request: Request) -> None:
        """A request back from the running set (preempted) or from a skipped
        admission: its place follows from its key, as in vLLM's priority queue."""
        tier = placement(request).tier
        self.running[tier] = max(0, self.running[tier] - 1)
        self.add_request(request)

    def prepend_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self.prepend_request(request)

    def remove_request(self, request: Request) -> None:
        self._discard(request)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for request in requests:
            self._discard(request)

    def _discard(self, request: Request) -> None:
        entry = self._entries.pop(request, None)
        if entry is None:
            return
        entry[-1] = None  # dropped from its heap when it reaches the top
        self._dead += 1
        if self._dead > 64 + len(self._entries):
            for tier, heap in self._heaps.items():
                self._heaps[tier] = [e for e in heap if e[-1] is not None]
                heapq.heapify(self._heaps[tier])
            self._dead = 0

    def __bool__(self) -> bool:
        return self._admissible() is not None

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        for tier in Tier:
            for entry in sorted(e for e in self._heaps[tier] if e[-1] is not None):
                yield entry[-1]
