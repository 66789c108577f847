"""hitchllm-lora: serve many PEFT LoRA adapters from one base model, batched together.

Start an engine with ``enable_lora=True`` and name an adapter per request with
``hitchllm.LoRARequest(lora_name, lora_int_id, lora_path)``. Adapters are loaded and unloaded
at run time through the engine (``add_lora`` / ``remove_lora``, which reach this plugin's
``LoRAManager`` by the ``hitchllm_lora_adapters`` hook) or ``manager_for(engine.config)``.
"""

from hitchllm_lora.manager import LoRAManager, manager_for

__all__ = ["LoRAManager", "manager_for"]
