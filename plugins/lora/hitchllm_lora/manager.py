"""One engine's LoRA state: the host cache, the device slots and pools, the scheduler gate.

Built by ``hitchllm_model_loaded`` when ``enable_lora`` is set, and found again by the other
hooks through the engine's config (``manager_for``) or its model (``manager_of_model``). The
engine reaches it through ``hitchllm_lora_adapters`` (``LLMEngine.add_lora`` / ``remove_lora``
/ ``list_loras``), which the server uses to load and unload adapters at run time.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch import nn

from hitchllm.config import EngineConfig
from hitchllm.engine.llm_engine import DEFAULT_MAX_NUM_BATCHED_TOKENS
from hitchllm.lora import LoRACounters, LoRARequest
from hitchllm_lora.adapter import read_adapter
from hitchllm_lora.cache import AdapterCache
from hitchllm_lora.gate import AdapterGate
from hitchllm_lora.layers import wrap_layers
from hitchllm_lora.slots import AdapterSlots
from hitchllm_lora.targets import find_targets

_MODEL_ATTRIBUTE = "hitchllm_lora_manager"
_ACTIVATION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# id(engine config) -> its manager. A manager holds its config, so the id cannot be reused
# while the entry lives; the entry goes with the manager (which the model holds).
_MANAGERS: weakref.WeakValueDictionary[int, LoRAManager] = weakref.WeakValueDictionary()


class LoRAManager:
    """Serves LoRA adapters for one engine: wraps the model's adaptable layers and owns the
    adapters' host cache, device slots and the scheduler's admission gate. The engine reaches
    it as its ``hitchllm.lora.LoRAAdapters`` (``hitchllm_lora_adapters``)."""

    def __init__(self, model: nn.Module, engine_config: EngineConfig) -> None:
        self.engine_config = engine_config
        # The activations' dtype: that of the unquantized parameters (quantized layers may
        # hold int8 or fp8 weights).
        param = next(p for p in model.parameters() if p.dtype in _ACTIVATION_DTYPES)
        dtype, device = param.dtype, param.device
        found = find_targets(model)
        if not found:
            raise ValueError(f"enable_lora: {type(model).__name__} has no layer LoRA can adapt "
                             "(q/k/v/o/gate/up/down projections)")
        targets = {name: t for layer in found.values() for name, t in layer}
        self.cache = AdapterCache(engine_config.cpu_lora_capacity, functools.partial(
            read_adapter, targets=targets, max_rank=engine_config.max_lora_rank, dtype=dtype,
            pin_memory=device.type == "cuda"))
        max_tokens = engine_config.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        self.slots = AdapterSlots(engine_config.max_loras, max_tokens, device, self.cache)
        self.slots.layers = wrap_layers(
            {prefix: [t for _, t in layer] for prefix, layer in found.items()}, self.slots,
            engine_config.max_lora_rank, dtype, device)
        self.gate = AdapterGate(engine_config.max_loras)
        setattr(model, _MODEL_ATTRIBUTE, self)
        _MANAGERS[id(engine_config)] = self

    def add_adapter(self, lora_request: LoRARequest) -> LoRARequest:
        """Load an adapter (read and check its directory, keep it in host memory) so requests
        may name it; returns the ``LoRARequest`` requests are bound to (an empty
        ``lora_path`` refers to the adapter already known under ``lora_name``, which is not
        read again).
        ``ValueError`` says what is wrong with the request or the directory. Thread-safe."""
        return self.cache.add(lora_request)

    def remove_adapter(self, lora_name: str) -> None:
        """Unload an adapter: new requests naming it are refused until it is added again;
        requests already accepted finish with it. ``ValueError`` if no adapter has that
        name. Thread-safe."""
        self.cache.remove(lora_name)

    def adapter_names(self) -> list[str]:
        """The loaded adapters' names, oldest first."""
        return self.cache.names()

    def list_adapters(self) -> list[LoRARequest]:
        """The loaded adapters, oldest first."""
        return self.cache.known()

    def counters(self) -> LoRACounters:
        """Adapters read from disk, evicted from host memory, and copied into device slots,
        since the engine started."""
        return LoRACounters(num_loads=self.cache.num_reads,
                            num_evictions=self.cache.num_evictions,
                            num_activations=self.slots.num_activations)


def manager_for(engine_config: EngineConfig) -> LoRAManager:
    """The LoRA manager of the engine built with ``engine_config``; ``ValueError`` when that
    engine serves no adapters (``enable_lora`` off)."""
    manager = _MANAGERS.get(id(engine_config))
    if manager is None or manager.engine_config is not engine_config:
        raise ValueError("this engine serves no LoRA adapters; start it with enable_lora=True "
                         "(--enable-lora)")
    return manager


def manager_of_model(model: nn.Module) -> LoRAManager | None:
    """The manager that wrapped ``model``'s layers, if any."""
    return getattr(model, _MODEL_ATTRIBUTE, None)
