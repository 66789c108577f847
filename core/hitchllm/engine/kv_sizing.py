"""How much CUDA memory the KV cache gets, from a memory profile of this process.

``gpu_memory_utilization`` is the share of the card this engine may use in all. From it we take
what the process needs besides the cache: the peak PyTorch allocation of a worst-case step
(weights included) and the memory outside PyTorch's allocator that the process gained since
start-up (cuBLAS workspaces, kernel modules). Memory other processes hold is not ours to count
or to claim: it only has to leave room for what we ask.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

GiB = 2**30


@dataclass
class MemorySnapshot:
    """Free and total device memory when the engine started, before it allocated anything."""

    free: int
    total: int

    @classmethod
    def take(cls, device: torch.device) -> MemorySnapshot:
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total)


def cuda_kv_cache_bytes(
    device: torch.device, start: MemorySnapshot, peak_torch: int, utilization: float
) -> int:
    """Bytes for the KV cache: ``utilization`` of the card minus this process's own needs.

    ``peak_torch`` is the peak ``torch.cuda.max_memory_allocated`` of the profiled step.
    Raises ``ValueError`` with the knob to turn when the budget is not positive or other
    processes hold so much that the budget does not fit in what is free.
    """
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    grown = start.free - free  # everything this process took since start-up
    non_torch = max(0, grown - reserved)
    ours = peak_torch + non_torch
    budget = int(total * utilization) - ours
    logger.info(
        "Memory profile: peak of a worst-case step %.2f GiB (weights included), outside "
        "PyTorch's allocator %.2f GiB; %.2f GiB of %.2f GiB x %.2f left for the KV cache",
        peak_torch / GiB, non_torch / GiB, max(budget, 0) / GiB, total / GiB, utilization)
    if budget <= 0:
        raise ValueError(
            f"the model needs {ours / GiB:.2f} GiB at its peak, more than "
            f"gpu_memory_utilization={utilization} of the card ({total * utilization / GiB:.2f} "
            "GiB) leaves: raise gpu_memory_utilization, or lower max_num_batched_tokens or "
            "max_num_seqs")
    available = free + reserved - torch.cuda.memory_allocated(device)
    if budget > available:
        others = total - start.free
        raise ValueError(
            f"the KV cache would take {budget / GiB:.2f} GiB but only {available / GiB:.2f} GiB "
            f"are free: other processes hold {others / GiB:.2f} GiB of this card. Lower "
            f"gpu_memory_utilization to at most {(ours + available) / total:.2f}, or set "
            "kv_cache_memory, or free the card")
    return budget
