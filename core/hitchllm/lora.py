"""``LoRARequest``: names the LoRA adapter a request runs with.

A plain dataclass in the core so that a request can name an adapter whatever is installed;
the adapters themselves are served by the ``hitchllm-lora`` plugin (``enable_lora=True``).
Without it, or with LoRA off, a request that names an adapter is refused, never run on the
base model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# The distribution that serves adapters; named in the errors of an engine that cannot.
LORA_PLUGIN = "hitchllm-lora"


@dataclass(frozen=True)
class LoRARequest:
    """One adapter, with vLLM's field names.

    ``lora_name`` identifies the adapter (prefix-cache blocks are never shared between
    names); ``lora_int_id`` is a positive integer id; ``lora_path`` is a directory holding
    ``adapter_config.json`` and ``adapter_model.safetensors`` in the PEFT format (it may be
    empty for an adapter the engine already has under ``lora_name``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""


@dataclass(frozen=True)
class LoRACounters:
    """Totals since the engine started: adapters read from disk into host memory
    (``num_loads``), dropped from host memory to make room (``num_evictions``), and copied
    into a device slot (``num_activations``)."""

    num_loads: int = 0
    num_evictions: int = 0
    num_activations: int = 0


class LoRAAdapters(Protocol):
    """What a plugin that serves adapters offers the engine (``hitchllm_lora_adapters``), so
    that a server can load, unload and list them at run time without importing the plugin.
    Every method may be called from another thread than the engine loop's."""

    def add_adapter(self, lora_request: LoRARequest) -> LoRARequest:
        """Read and check the adapter's directory and make its name known; returns the
        bound ``LoRARequest``. ``ValueError`` says what is wrong (nothing changes then)."""

    def remove_adapter(self, lora_name: str) -> None:
        """Forget the adapter (accepted requests finish with it); ``ValueError`` if no
        adapter has that name."""

    def list_adapters(self) -> list[LoRARequest]:
        """The known adapters, oldest first."""

    def counters(self) -> LoRACounters:
        """Load, eviction and activation totals."""
