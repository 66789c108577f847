"""Physical KV cache blocks: reference counts, a free queue in LRU order, the prefix cache map."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from hitchllm.kv_cache.hashing import BlockHash


@dataclass(eq=False)
class KVCacheBlock:
    """One physical block of the paged KV cache.

    ``ref_cnt`` counts the requests using the block; at 0 the block sits in the free queue.
    ``block_hash`` is set while the block is registered in the prefix cache: a free block can
    keep its hash (and be hit again) until it is evicted for reuse.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Links of the intrusive free queue; repr=False because printing them would recurse.
    prev_free: KVCacheBlock | None = field(default=None, repr=False)
    next_free: KVCacheBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly-linked list of free blocks threaded through the blocks themselves.

    The head is the next block to reuse (least recently freed), the tail the most recently
    freed. Unlike a ``deque``, a block can be taken out of the middle in O(1), which a prefix
    cache hit on a free block needs.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        # Sentinels mean no None checks at the ends, and "in the queue" is just prev_free set.
        self._head = KVCacheBlock(block_id=-1)
        self._tail = KVCacheBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head (evicted first) to tail."""
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block; raises ``IndexError`` when empty."""
        if self._len == 0:
            raise IndexError("popleft from an empty FreeBlockQueue")
        block = self._head.next_free
        assert block is not None
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is in the queue."""
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add ``block`` at the tail (it will be reused last)."""
        if block.prev_free is not None:
            raise ValueError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1


class BlockPool:
    """All physical blocks, the free queue, and the map from block hash to cached block."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self._cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request uses, including cached ones (those are evictable)."""
        return len(self.free_block_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one request, in [0, 1]."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the LRU head with ``ref_cnt`` 1, evicting cached ones."""
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} blocks but only {self.num_free_blocks} are free")
        blocks = []
        for _ in range(n):
            block = self.free_block_queue.popleft()
            self.uncache(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def uncache(self, block: KVCacheBlock) -> None:
        """Forget ``block``'s hash (it is reused, or its contents are not what the hash says);
        no-op when it has none."""
        if block.block_hash is None:
            return
        # A duplicate block never owns its hash's map entry, so only drop an entry that is ours.
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix cache hit); free ones leave the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; those reaching 0 go to the queue tail in order.

        Pass a request's blocks last-first so its tail blocks (the least likely to be shared
        by another prompt) are evicted before its head blocks.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"block {block.block_id} freed more times than it was taken")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        """The block registered under ``block_hash``, free or in use, or ``None``."""
        return self._cached.get(block_hash)

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Register a full block under ``block_hash`` so later prompts can hit it.

        If another block already holds that hash (two requests computed the same content at
        once), the existing entry wins and ``block`` stays uncached; it is still correct, just
        not shareable.
        """
        if block.block_hash is not None or block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only allowed while no block is in use. Returns success."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self._cached.clear()
        for block in self.blocks:
            block.block_hash = None
        return True
