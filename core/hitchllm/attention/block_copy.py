"""Copy-on-write on the device: copy whole KV blocks within every layer's cache tensor.

Backends lay their cache tensors out differently (the block index is dimension 0, 1 or 2), so
the block dimension of each layer is found from the backend's own shape function: it is the
one dimension that grows with the number of blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hitchllm.attention.backend import AttentionBackend
from hitchllm.attention.kv_cache_spec import KVCacheSpec


def block_dim(backend: type[AttentionBackend], kv_spec: KVCacheSpec) -> int:
    """The dimension of ``backend``'s cache tensor for ``kv_spec`` that indexes blocks."""
    one = backend.get_kv_cache_shape_for_spec(1, kv_spec)
    two = backend.get_kv_cache_shape_for_spec(2, kv_spec)
    grown = [d for d, (a, b) in enumerate(zip(one, two, strict=True)) if a != b]
    if len(grown) != 1:
        raise ValueError(f"{backend.name}: cannot tell the block dimension of its KV cache "
                         f"shape {one} (1 block) vs {two} (2 blocks)")
    return grown[0]


def copy_blocks(caches: Sequence[torch.Tensor], dims: Sequence[int],
                copies: Sequence[tuple[int, int]]) -> None:
    """Copy block ``src`` onto block ``dst`` for every pair in ``copies``, in every cache.

    Pairs are applied together: every source is gathered first. That equals copying in order
    because no destination is the source of a later pair (a destination is fresh, held by one
    request, and only forks, which happen between steps, share a block).
    """
    if not copies or not caches:
        return
    device = caches[0].device
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64).to(device, non_blocking=True)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64).to(device, non_blocking=True)
    for cache, dim in zip(caches, dims, strict=True):
        # fp8 caches: index_copy_ has no fp8 kernel everywhere; the bytes are what matter.
        raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
        raw.index_copy_(dim, dst, raw.index_select(dim, src))
