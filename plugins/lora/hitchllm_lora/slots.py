"""The device side: which adapter sits in each of the ``max_loras`` pool slots, and each
token's slot for the step about to run.

Before every step (``hitchllm_before_forward``) the step's adapters are made active: one not
in a slot yet is copied from host memory into a free slot, or into the least recently used
slot whose adapter no running request needs (the scheduler's gate keeps the running requests
to ``max_loras`` adapters, so there always is one). A slot is never given away while a
running request uses its adapter, scheduled in this step or not. Then each token gets its
request's slot (-1 for the base model) in ``token_slot``, a device buffer allocated once and
written in place, as CUDA-graph replay needs; tokens past the step's (graph padding) are -1.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from hitchllm.engine.input_batch import RequestState
from hitchllm.engine.step_buffers import HostDeviceBuffer
from hitchllm.lora import LoRARequest
from hitchllm_lora.cache import AdapterCache, AdapterKey, adapter_key
from hitchllm_lora.layers import LayerLoRA

if TYPE_CHECKING:  # the Triton kernels load on first use (start-up time)
    from hitchllm_lora.kernels import SlotGroups

logger = logging.getLogger("hitchllm.lora")


class AdapterSlots:
    """Slot assignment and the per-token slot buffer shared by every adapted layer."""

    def __init__(
        self, num_slots: int, max_num_tokens: int, device: torch.device, cache: AdapterCache
    ) -> None:
        self.num_slots = num_slots
        self.device = device
        self.cache = cache
        self.layers: list[LayerLoRA] = []
        self.keys: list[AdapterKey | None] = [None] * num_slots
        self._last_used = [0] * num_slots
        self._step = 0
        self.scaling = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self._token_slot = HostDeviceBuffer(max_num_tokens, torch.int32, device)
        self._token_slot.np[:] = -1
        self._token_slot.to_device(max_num_tokens)
        self.token_slot = self._token_slot.device
        # Tokens of the last step; every entry past it is -1.
        self._num_filled = 0
        self._copied: torch.cuda.Event | None = None
        # Whether any token of the step has an adapter. An eager step without one skips the
        # LoRA terms; a CUDA graph (captured while this is True) always applies them, which
        # with every token at -1 adds nothing.
        self.in_use = True
        self.num_activations = 0
        # The current forward's tokens grouped by slot (CUDA kernels; see ``layers``).
        self.groups: SlotGroups | None = None

    def prepare(
        self, requests: Sequence[RequestState], num_scheduled_tokens: Sequence[int],
        running: Collection[RequestState],
    ) -> None:
        """Activate the step's adapters and write each token's slot."""
        self._step += 1
        keys = [adapter_key(r.lora_request) for r in requests]
        slot_of = {k: i for i, k in enumerate(self.keys) if k is not None}
        missing = {k: r.lora_request for k, r in zip(keys, requests)
                   if k is not None and k not in slot_of}
        if missing:
            needed = {k for k in keys if k is not None}
            held = needed | {adapter_key(r.lora_request) for r in running}
            for key, lora_request in missing.items():
                slot_of[key] = self._activate(lora_request, held)
        rows = np.fromiter((-1 if k is None else slot_of[k] for k in keys), dtype=np.int32,
                           count=len(keys))
        for slot in set(rows.tolist()) - {-1}:
            self._last_used[slot] = self._step
        self.in_use = bool((rows >= 0).any())
        self._write_token_slots(np.repeat(rows, num_scheduled_tokens))

    def _activate(self, request: LoRARequest, held: set[AdapterKey | None]) -> int:
        """Copy ``request``'s adapter into a slot no running request needs; its index."""
        free = [i for i, k in enumerate(self.keys) if k is None]
        if not free:
            free = [i for i, k in enumerate(self.keys) if k not in held]
        if not free:
            raise RuntimeError(
                f"all {self.num_slots} LoRA slots hold adapters of running requests; the "
                "admission gate should have kept this request waiting")
        slot = min(free, key=lambda i: self._last_used[i])
        adapter = self.cache.get(request)
        replaced, self.keys[slot] = self.keys[slot], None  # half-written: no one's slot
        copy_async = self.device.type == "cuda"
        for layer in self.layers:
            for pool in layer.slices:
                pool.a[slot].zero_()
                pool.b[slot].zero_()
                weights = adapter.weights.get((layer.prefix, pool.target.shard_id))
                if weights is not None:
                    rank = weights.a.shape[0]
                    pool.a[slot, :rank].copy_(weights.a, non_blocking=copy_async)
                    pool.b[slot, :, :rank].copy_(weights.b, non_blocking=copy_async)
        self.scaling[slot] = adapter.scaling
        self.keys[slot] = adapter_key(request)
        self.num_activations += 1
        logger.debug("LoRA adapter %r now in device slot %d (replacing %r)",
                     request.lora_name, slot, replaced and replaced[0])
        return slot

    def _write_token_slots(self, token_slots: np.ndarray) -> None:
        buf = self._token_slot
        if self._copied is not None:  # the last step's copy out of the host buffer is done
            self._copied.synchronize()
        num_tokens = len(token_slots)
        buf.np[:num_tokens] = token_slots
        buf.np[num_tokens : self._num_filled] = -1
        buf.to_device(max(num_tokens, self._num_filled))
        self._num_filled = num_tokens
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
