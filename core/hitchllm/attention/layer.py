"""The ``Attention`` layer models call; which kernel runs is decided by the engine."""

from __future__ import annotations

import torch
from torch import nn

from hitchllm.attention.backend import AttentionImpl
from hitchllm.attention.forward_context import get_forward_context


class Attention(nn.Module):
    """Paged attention over the engine's KV cache: ``out = attn(q, k, v)``.

    ``q`` is [num_tokens, num_heads * head_size]; ``k`` and ``v`` are
    [num_tokens, num_kv_heads * head_size], for the whole packed batch. The layer writes the new
    K/V into its slice of the paged cache, then attends. The engine binds an ``AttentionImpl``
    and this layer's cache tensor with ``bind`` after choosing a backend.
    """

    def __init__(
        self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, layer_index: int
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_index = layer_index
        self.impl: AttentionImpl | None = None
        self.kv_cache: torch.Tensor | None = None

    def bind(self, impl: AttentionImpl | None, kv_cache: torch.Tensor | None) -> None:
        """Attach the kernel and this layer's KV-cache tensor (None, None detaches them)."""
        self.impl = impl
        self.kv_cache = kv_cache

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.impl is None or self.kv_cache is None:
            raise RuntimeError(
                f"attention layer {self.layer_index} has no backend bound; build the model "
                "through hitchllm's engine"
            )
        metadata = get_forward_context().attn_metadata
        out = self.impl.forward(
            q.view(-1, self.num_heads, self.head_size),
            k.view(-1, self.num_kv_heads, self.head_size),
            v.view(-1, self.num_kv_heads, self.head_size),
            self.kv_cache,
            metadata,
        )
        return out.reshape(-1, self.num_heads * self.head_size)
