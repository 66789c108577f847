"""Which running request gives up its blocks when the KV cache runs out."""

from __future__ import annotations

import enum

from hitchllm.request import Request


class PreemptionPolicy(enum.Enum):
    """FCFS preempts the most recently admitted request; PRIORITY the lowest-priority one
    (largest ``priority`` value, as in vLLM), latest arrival first among equals."""

    FCFS = "fcfs"
    PRIORITY = "priority"

    def pick_victim(self, running: list[Request]) -> Request:
        if self is PreemptionPolicy.FCFS:
            return running[-1]
        return max(running, key=lambda r: (r.priority, r.arrival_time))
