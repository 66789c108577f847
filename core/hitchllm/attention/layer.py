"""The ``Attention`` layer models call; which kernel runs is decided by the engine."""

from __future__ import annotations

import torch
from torch import nn

from hitchllm.attention.backend import AttentionImpl
from hitchllm.attention.forward_context import get_forward_context
from hitchllm.attention.kv_cache_spec import KVCacheSpec


class Attention(nn.Module):
    """Paged attention over the engine's KV cache: ``out = attn(q, k, v)``.

    ``q`` is [num_tokens, num_heads * head_size]; ``k`` and ``v`` are
    [num_tokens, num_kv_heads * head_size], for the whole packed batch. The layer writes the new
    K/V into its slice of the paged cache, then attends. The engine binds an ``AttentionImpl``
    and this layer's cache tensor with ``bind`` after choosing a backend.

    What the layer keeps per token is declared by ``get_kv_cache_spec``. ``k_scale`` and
    ``v_scale`` (float32 scalars, 1.0 by default) are the scales of an fp8 cache: stored
    value = K / k_scale. Nothing loads them from a checkpoint yet; a quantization method may
    set them in place (``layer.k_scale.fill_(s)``) before the first step.
    """

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(
        self, num_heads: int, head_size: int, num_kv_heads: int, scale: float, layer_index: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.layer_index = layer_index
        self.sliding_window = sliding_window
        self.impl: AttentionImpl | None = None
        self.kv_cache: torch.Tensor | None = None
        # Buffers, so they follow the model to its device; not parameters, so checkpoints
        # need not carry them.
        self.register_buffer("k_scale", torch.tensor(1.0, dtype=torch.float32),
                             persistent=False)
        self.register_buffer("v_scale", torch.tensor(1.0, dtype=torch.float32),
                             persistent=False)

    def get_kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        """What this layer stores per token in a cache of ``dtype`` with ``block_size``-token
        blocks (an MLA layer overrides this to declare its latent cache)."""
        return KVCacheSpec.for_attention(self.num_kv_heads, self.head_size, dtype, block_size,
                                         self.sliding_window)

    def bind(self, impl: AttentionImpl | None, kv_cache: torch.Tensor | None) -> None:
        """Attach the kernel and this layer's KV-cache tensor (None, None detaches them).
        The impl reads the layer's fp8 scales from then on."""
        self.impl = impl
        self.kv_cache = kv_cache
        if impl is not None:
            impl.k_scale, impl.v_scale = self.k_scale, self.v_scale

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
