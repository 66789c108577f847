"""The plugin's hooks: wrap the model's layers when LoRA is on, check and load each request's
adapter, keep running adapters within ``max_loras``, activate the step's adapters before the
forward pass, and key prefix-cache blocks by adapter."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from torch import nn

from hitchllm import hookimpl
from hitchllm.config import EngineConfig
from hitchllm.engine.input_batch import RequestState
from hitchllm.request import Request
from hitchllm.scheduler.admission import AdmissionGate
from hitchllm_lora.cache import adapter_key
from hitchllm_lora.manager import LoRAManager, manager_for, manager_of_model


@hookimpl
def hitchllm_model_loaded(model: nn.Module, engine_config: EngineConfig) -> None:
    """With ``enable_lora``, wrap every adaptable linear layer and allocate the pools."""
    if engine_config.enable_lora:
        LoRAManager(model, engine_config)


@hookimpl
def hitchllm_lora_adapters(engine_config: EngineConfig) -> LoRAManager | None:
    """The engine's adapter manager, through which a server loads and unloads adapters."""
    return manager_for(engine_config) if engine_config.enable_lora else None


@hookimpl
def hitchllm_request_added(request: Request, engine_config: EngineConfig) -> None:
    """Check the request's adapter and, when it is new, load it into host memory (a
    ``ValueError`` says what is wrong); the request is bound to the adapter's load."""
    if request.lora_request is not None:
        request.lora_request = manager_for(engine_config).add_adapter(request.lora_request)


@hookimpl
def hitchllm_admission_gates(engine_config: EngineConfig) -> list[AdmissionGate]:
    """At most ``max_loras`` adapters among the running requests."""
    return [manager_for(engine_config).gate] if engine_config.enable_lora else []


@hookimpl
def hitchllm_before_forward(
    requests: list[RequestState], num_scheduled_tokens: list[int], model: nn.Module,
    running_requests: Collection[RequestState],
) -> None:
    """Put the step's adapters in device slots and map each token to its slot."""
    manager = manager_of_model(model)
    if manager is not None:
        manager.slots.prepare(requests, num_scheduled_tokens, running_requests)


@hookimpl
def hitchllm_block_hash_extra_keys(request: Request) -> tuple[Any, ...] | None:
    """The adapter's directory and load (the core already keys blocks by adapter name), so
    a name unloaded and loaded again, from another directory or the same one rewritten,
    never reuses the old blocks."""
    key = adapter_key(request.lora_request)
    return None if key is None else key[1:]
