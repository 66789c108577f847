"""Attention: one API (``Attention`` layer), many kernels (backends chosen by the selector)."""

from hitchllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
    CudaGraphSupport,
)
from hitchllm.attention.forward_context import (
    get_forward_context,
    real_rows,
    set_forward_context,
)
from hitchllm.attention.kv_cache_spec import (
    FP8_DTYPES,
    KVCacheKind,
    KVCacheSpec,
    bytes_per_shared_block,
)
from hitchllm.attention.kv_quant import dequantize_kv, quantize_kv
from hitchllm.attention.layer import KV_SCALE_CHECKPOINT_NAMES, Attention, kv_scale_target
from hitchllm.attention.paged_write import (
    kernel_reasons,
    nhd_cache_shape,
    pad_rows,
    write_nhd,
)
from hitchllm.attention.torch_backend import TorchAttentionBackend

__all__ = [
    "FP8_DTYPES",
    "KV_SCALE_CHECKPOINT_NAMES",
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadataBuilder",
    "AttentionSpec",
    "CommonAttentionMetadata",
    "CudaGraphSupport",
    "KVCacheKind",
    "KVCacheSpec",
    "TorchAttentionBackend",
    "bytes_per_shared_block",
    "dequantize_kv",
    "get_forward_context",
    "kernel_reasons",
    "kv_scale_target",
    "nhd_cache_shape",
    "pad_rows",
    "quantize_kv",
    "real_rows",
    "set_forward_context",
    "write_nhd",
]
