"""hitchllm-lora: serve many PEFT LoRA adapters from one base model, batched together.

Start an engine with ``enable_lora=True`` and name an adapter per request with
``hitchllm.LoRARequest(lora_name, lora_int_id, lora_path)``. A server loads and unloads
adapters at run time through ``manager_for(engine.config)``'s ``add_adapter`` /
``remove_adapter``.
"""

from hitchllm_lora.manager import LoRAManager, manager_for

__all__ = ["LoRAManager", "manager_for"]
