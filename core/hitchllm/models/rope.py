"""Rotary position embedding (neox / rotate-half layout) with the common scaling schemes."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from hitchllm.models import fused

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies (float32, [head_dim // 2]) after applying ``scaling``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    rope_type = "default" if scaling is None else scaling["rope_type"]
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(
        f"rope scaling type {rope_type!r} is not supported; supported: "
        f"{', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between interpolated linearly in 1/wavelength.
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    original_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    long = wavelen > original_len / low
    short = wavelen < original_len / high
    smooth = (original_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    return torch.where(long, inv_freq / factor, torch.where(short, inv_freq, blended))


class RotaryEmbedding(nn.Module):
    """Applies rotary embedding to packed queries and keys given each token's position."""

    def __init__(
        self, head_dim: int, max_position: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = rope_inv_freq(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        # Kept in float32 and cast per call, as the reference implementation does.
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q``: [T, heads, head_dim], ``k``: [T, kv_heads, head_dim]; positions: [T]."""
        return fused.rotary(positions, q, k, self.cos, self.sin)
