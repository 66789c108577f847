"""Scheduling order and which running request gives up its blocks when the KV cache runs out."""

from __future__ import annotations

import enum
from collections import deque

from hitchllm.request import Request


class PreemptionPolicy(enum.Enum):
    """FCFS serves requests in arrival order and preempts the most recently admitted one.
    PRIORITY serves the lowest ``priority`` value first (as in vLLM) and preempts the largest
    value, latest arrival first among equals."""

    FCFS = "fcfs"
    PRIORITY = "priority"

    def pick_victim(self, candidates: list[Request]) -> Request:
        """The request to preempt among ``candidates`` (running, not yet scheduled this step,
        in admission order)."""
        if self is PreemptionPolicy.FCFS:
            return candidates[-1]
        return max(candidates, key=lambda r: (r.priority, r.arrival_time))

    def enqueue(self, waiting: deque[Request], request: Request, front: bool = False) -> None:
        """Put ``request`` in the waiting queue: FCFS at the back (the front for a preempted
        request), PRIORITY in (priority, arrival) order."""
        if self is PreemptionPolicy.FCFS:
            if front:
                waiting.appendleft(request)
            else:
                waiting.append(request)
            return
        key = (request.priority, request.arrival_time)
        for i, other in enumerate(waiting):
            if (other.priority, other.arrival_time) > key:
                waiting.insert(i, request)
                return
        waiting.append(request)
