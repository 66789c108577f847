"""Admission gates: plugin rules that hold a waiting request back until it may run.

The scheduler admits waiting requests in queue order. A gate (from a plugin's
``hitchllm_admission_gates``) may refuse one for now, when a resource the request needs is
held by running requests: the LoRA plugin has one slot per active adapter, so a request for
another adapter waits while every slot serves running requests. A refused request keeps its
place in the queue and is asked about again every step; the requests behind it may go first.

The scheduler tells each gate which requests enter and leave the running set, so that
``may_admit`` can answer in constant time however long the queues are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from hitchllm.request import Request


class AdmissionGate(ABC):
    """Decides whether a waiting request may start running now."""

    @abstractmethod
    def may_admit(self, request: Request) -> bool:
        """True if ``request`` (waiting, or preempted and waiting again) may join the running
        requests in this step. Must not fail the request: a request a gate can never admit
        has to be refused when it is added (``hitchllm_request_added``)."""

    @abstractmethod
    def admitted(self, request: Request) -> None:
        """``request`` joined the running requests."""

    @abstractmethod
    def released(self, request: Request) -> None:
        """``request`` left the running requests (finished, aborted or preempted)."""
