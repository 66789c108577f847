"""Storing K/V in an fp8 cache and reading them back, with a layer's per-tensor scale.

A stored value is ``K / scale`` clamped to the fp8 format's finite range (a plain cast would
turn out-of-range values into NaN for e4m3 or inf for e5m2); reading multiplies by ``scale``.
With the default scale of 1.0 the only change to K/V is fp8's rounding. Caches in the model's
own dtype pass through unchanged.
"""

from __future__ import annotations

import torch

from hitchllm.attention.kv_cache_spec import FP8_DTYPES


def quantize_kv(x: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``x`` as the cache stores it in ``dtype`` (``scale``: float32 scalar, None = 1.0)."""
    if dtype not in FP8_DTYPES:
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    x = x.float()
    if scale is not None:
        x = x / scale
    return x.clamp(-limit, limit).to(dtype)


def dequantize_kv(
    stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """Cache contents ``stored`` back in the compute ``dtype``; the scale is applied in
    float32 so that only the final cast rounds."""
    if stored.dtype not in FP8_DTYPES:
        return stored.to(dtype)
    x = stored.float()
    if scale is not None:
        x = x * scale
    return x.to(dtype)
