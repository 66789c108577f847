"""Helpers for kernel backends: the validate reasons they share, and (for those whose cache
holds keys and values of whole tokens) the cache write and output padding.

Backends whose cache is ``(2, num_blocks + 1, block_size, num_kv_heads, head_size)`` (keys at
index 0, values at 1; FlashInfer's and FlashAttention's "NHD" page layout, plus one spare
block) can share this write: padding slots (-1) are redirected to the spare last block, so the
write is two ``index_copy_`` calls with no data-dependent shapes and no host sync, which keeps
it safe inside CUDA graphs. ``kernel_reasons`` lists the limits attention kernels commonly
share (GPU ones and CPU_ATTN's), worded the same for every backend; ``pad_rows`` pads a
kernel's output back to the layer's row count.
"""

from __future__ import annotations

import torch

from hitchllm.attention.backend import AttentionSpec
from hitchllm.attention.kv_cache_spec import FP8_DTYPES


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


def kernel_reasons(
    spec: AttentionSpec, dtypes: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16)
) -> list[str]:
    """Reasons an attention kernel (by default a half-precision GPU one) cannot serve
    ``spec``: an MLA model, a dtype outside ``dtypes``, a KV-cache dtype other than the
    model's (fp8 included), query heads that are not a multiple of the KV heads. A backend
    adds its own (device, head sizes, ...)."""
    reasons = []
    if spec.use_mla:
        reasons.append("MLA models need an MLA backend (TRITON_MLA or TORCH_MLA, from "
                       "hitchllm-attention-mla)")
    if spec.dtype not in dtypes:
        names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        reasons.append(f"dtype {spec.dtype} is not supported (use {names})")
    if spec.kv_cache_dtype in FP8_DTYPES:
        reasons.append(f"an fp8 KV cache ({spec.kv_cache_dtype}) is not supported: this "
                       "backend's kernels read K/V in the model dtype (use kv_cache_dtype=auto, "
                       "or the TORCH backend for fp8)")
    elif spec.kv_cache_dtype != spec.dtype:
        reasons.append(f"KV-cache dtype {spec.kv_cache_dtype} differs from the model dtype "
                       f"{spec.dtype}; this backend needs them equal")
    if spec.num_heads % spec.num_kv_heads:
        reasons.append(f"{spec.num_heads} query heads are not a multiple of "
                       f"{spec.num_kv_heads} KV heads")
    return reasons


def pad_rows(out: torch.Tensor, rows: int) -> torch.Tensor:
    """``out`` ([n, ...], a kernel's output for the step's n real tokens) as ``rows`` rows,
    zeros after the first n: the layer's output must match its (possibly padded) input. No
    copy when there is no padding."""
    if out.shape[0] == rows:
        return out
    padded = out.new_zeros(rows, *out.shape[1:])
    padded[: out.shape[0]] = out
    return padded
