"""Paged KV cache bookkeeping: block pool, prefix cache hashes, per-request block tables."""

from hitchllm.kv_cache.block_pool import BlockPool, KVCacheBlock
from hitchllm.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager"]
