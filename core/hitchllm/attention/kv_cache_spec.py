"""What one attention layer keeps in the KV cache per token, and what a block of it costs.

Each ``Attention`` layer declares a ``KVCacheSpec``; the engine sizes the cache, allocates each
layer's tensor and counts blocks from these specs, never from the model's dtype. All layers
share one block pool and one block table per request: block id ``b`` addresses the same token
range in every layer's tensor, so one block of the pool costs the sum of the layers'
``bytes_per_block`` (see ``bytes_per_shared_block``). Layers of different kinds (full
attention beside sliding window, say) therefore still hold a page per block for every token;
separate pools per kind, where a sliding-window layer frees pages that fell out of its window,
are future work.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: The fp8 formats a KV cache may use; backends that accept them dequantize with the layer's
#: ``k_scale`` / ``v_scale``.
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


class KVCacheKind(enum.Enum):
    """What a layer's cache holds per token."""

    #: A key and a value vector per KV head, for every token of the sequence.
    FULL_ATTENTION = "full_attention"
    #: The same, but the layer attends only to the last ``sliding_window`` tokens.
    SLIDING_WINDOW = "sliding_window"
    #: Multi-head latent attention (DeepSeek V2/V3): one compressed latent vector per token
    #: (``kv_lora_rank`` plus the rotary part of the key), shared by every head; keys and
    #: values are projected from it, so no separate K and V are stored.
    MLA_LATENT = "mla_latent"


@dataclass(frozen=True)
class KVCacheSpec:
    """One layer's KV cache per token.

    ``head_size`` is the width of one stored vector: a key's (and a value's) head size for
    the attention kinds, the latent width (``kv_lora_rank + rope dim``) for ``MLA_LATENT``,
    whose ``num_kv_heads`` is 1.
    """

    kind: KVCacheKind
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.num_kv_heads < 1 or self.head_size < 1 or self.block_size < 1:
            raise ValueError(f"KV-cache spec needs positive heads, head size and block size: "
                             f"{self}")
        if (self.kind is KVCacheKind.SLIDING_WINDOW) != (self.sliding_window is not None):
            raise ValueError("a sliding_window size is given exactly for SLIDING_WINDOW specs")
        if self.kind is KVCacheKind.MLA_LATENT and self.num_kv_heads != 1:
            raise ValueError("an MLA latent cache stores one vector per token (num_kv_heads=1)")

    @classmethod
    def for_attention(
        cls, num_kv_heads: int, head_size: int, dtype: torch.dtype, block_size: int,
        sliding_window: int | None = None,
    ) -> KVCacheSpec:
        """Keys and values per KV head: full attention, or windowed when ``sliding_window``
        is set."""
        kind = KVCacheKind.FULL_ATTENTION if sliding_window is None else \
            KVCacheKind.SLIDING_WINDOW
        return cls(kind, num_kv_heads, head_size, dtype, block_size, sliding_window)

    @classmethod
    def for_mla(
        cls, kv_lora_rank: int, rope_head_dim: int, dtype: torch.dtype, block_size: int
    ) -> KVCacheSpec:
        """One latent vector of ``kv_lora_rank + rope_head_dim`` per token."""
        return cls(KVCacheKind.MLA_LATENT, 1, kv_lora_rank + rope_head_dim, dtype, block_size)

    @property
    def vectors_per_token(self) -> int:
        """Vectors stored per token and KV head: a key and a value, or one latent."""
        return 1 if self.kind is KVCacheKind.MLA_LATENT else 2

    @property
    def bytes_per_token(self) -> int:
        return (self.vectors_per_token * self.num_kv_heads * self.head_size
                * self.dtype.itemsize)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block (``block_size`` tokens) of this layer's cache: its page size."""
        return self.block_size * self.bytes_per_token


def bytes_per_shared_block(specs: Sequence[KVCacheSpec]) -> int:
    """Bytes one block of the shared pool costs: every layer's page of it. Raises
    ``ValueError`` when the layers disagree on the block size, which one block table
    cannot address."""
    if not specs:
        raise ValueError("the model has no attention layer to size a KV cache for")
    sizes = {s.block_size for s in specs}
    if len(sizes) > 1:
        raise ValueError(f"attention layers declare different block sizes {sorted(sizes)}; "
                         "one shared block table needs one block size")
    return sum(s.bytes_per_block for s in specs)
