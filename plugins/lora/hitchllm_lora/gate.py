"""The scheduler-side rule: at most ``max_loras`` adapters among the running requests."""

from __future__ import annotations

from collections import Counter

from hitchllm.request import Request
from hitchllm.scheduler.admission import AdmissionGate
from hitchllm_lora.cache import AdapterKey, adapter_key


class AdapterGate(AdmissionGate):
    """Holds a request for an adapter back while ``max_loras`` other adapters are running;
    the base model and adapters already running are always admitted."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.running: Counter[AdapterKey] = Counter()

    def may_admit(self, request: Request) -> bool:
        key = adapter_key(request.lora_request)
        return key is None or key in self.running or len(self.running) < self.max_loras

    def admitted(self, request: Request) -> None:
        key = adapter_key(request.lora_request)
        if key is not None:
            self.running[key] += 1

    def released(self, request: Request) -> None:
        key = adapter_key(request.lora_request)
        if key is not None:
            self.running[key] -= 1
            if not self.running[key]:
                del self.running[key]
