"""DeepSeek's rotary embedding: applied to the rotary part of queries and keys only, with
YaRN scaling and DeepSeek's mscale.

Layout: DeepSeek-V2 (and V3 with ``rope_interleave``, its default) rotates interleaved pairs
``(x0, x1), (x2, x3), ...``; V3 with ``rope_interleave=false`` rotates halves (neox). Queries
and keys are permuted alike, so where the rotated pairs land does not change any score: the
output is laid out as ``[even parts, odd parts]``.

Scales (as transformers' DeepSeek models): YaRN's attention factor multiplies cos and sin (so
the rope part of every score by its square), and with ``mscale_all_dim`` the softmax scale is
multiplied by ``yarn_mscale(factor, mscale_all_dim) ** 2`` (see ``softmax_scale``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "yarn")


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context ``factor`` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(qk_head_dim: int, scaling: dict[str, Any] | None) -> float:
    """``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim) ** 2`` when the
    rope is scaled and ``mscale_all_dim`` is set."""
    scale = qk_head_dim ** -0.5
    if scaling is not None and scaling.get("mscale_all_dim"):
        scale *= yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2
    return scale


def yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any], max_position: int
                  ) -> tuple[torch.Tensor, float]:
    """YaRN's inverse frequencies ([dim // 2], float32) and attention factor: long
    wavelengths interpolated by ``factor``, short ones kept, a linear ramp between the
    ``beta_fast`` / ``beta_slow`` rotation counts over the original context."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
                     if mscale and mscale_all else yarn_mscale(factor))
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a one-point ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)


class DeepseekRotaryEmbedding(nn.Module):
    """Rotates the ``dim``-wide rotary parts of packed queries and keys by position."""

    def __init__(self, dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None, interleaved: bool) -> None:
        super().__init__()
        rope_type = "default" if scaling is None else scaling["rope_type"]
        if rope_type == "default":
            inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
            attention = 1.0
        elif rope_type == "yarn":
            inv_freq, attention = yarn_inv_freq(dim, theta, scaling or {}, max_position)
        else:
            raise ValueError(f"rope scaling type {rope_type!r} is not supported for DeepSeek "
                             f"models; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
        angles = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos", angles.cos() * attention, persistent=False)
        self.register_buffer("sin", angles.sin() * attention, persistent=False)
        self.interleaved = interleaved

    def forward(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q_pe`` [T, heads, dim], ``k_pe`` [T, dim]; positions [T]."""
        cos = self.cos[positions].to(q_pe.dtype)
        sin = self.sin[positions].to(q_pe.dtype)
        return (self._rotate(q_pe, cos[:, None], sin[:, None]),
                self._rotate(k_pe, cos, sin))

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
