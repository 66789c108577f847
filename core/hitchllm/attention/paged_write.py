"""Writing a step's new K/V into a paged cache laid out as keys and values of whole tokens.

Backends whose cache is ``(2, num_blocks + 1, block_size, num_kv_heads, head_size)`` (keys at
index 0, values at 1; FlashInfer's and FlashAttention's "NHD" page layout, plus one spare
block) can share this write: padding slots (-1) are redirected to the spare last block, so the
write is two ``index_copy_`` calls with no data-dependent shapes and no host sync, which keeps
it safe inside CUDA graphs.
"""

from __future__ import annotations

import torch


def nhd_cache_shape(
    num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
) -> tuple[int, ...]:
    """The cache shape ``write_nhd`` expects: ``num_blocks`` pages plus the spare one."""
    return (2, num_blocks + 1, block_size, num_kv_heads, head_size)


def write_nhd(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write ``key``/``value`` ([>= num_slots, num_kv_heads, head_size]) to their slots.

    ``slot_mapping`` ([num_slots] int64) gives each token's slot, ``-1`` for padding tokens,
    whose K/V land in the spare block that no block table references.
    """
    _, blocks, block_size, heads, head_size = kv_cache.shape
    flat = kv_cache.view(2, blocks * block_size, heads * head_size)
    n = slot_mapping.shape[0]
    slots = slot_mapping.masked_fill(slot_mapping < 0, (blocks - 1) * block_size)
    flat[0].index_copy_(0, slots, key[:n].reshape(n, -1).to(flat.dtype))
    flat[1].index_copy_(0, slots, value[:n].reshape(n, -1).to(flat.dtype))
