"""``LoRARequest``: names the LoRA adapter a request runs with.

A plain dataclass in the core so that a request can name an adapter whatever is installed;
the adapters themselves are served by the ``hitchllm-lora`` plugin (``enable_lora=True``).
Without it, or with LoRA off, a request that names an adapter is refused, never run on the
base model.
"""

from __future__ import annotations

from dataclasses import dataclass

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
