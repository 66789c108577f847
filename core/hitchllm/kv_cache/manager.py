"""Which physical blocks each request owns, and prefix cache lookups and registration."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from hitchllm.kv_cache.block_pool import BlockPool, KVCacheBlock
from hitchllm.kv_cache.hashing import BlockHash, hash_block_tokens
from hitchllm.kv_cache.host_swap import HostSwapSpace
from hitchllm.request import Request


class KVCacheManager:
    """Allocates KV cache blocks to requests and shares identical full prefix blocks.

    A request *uses hashing* when prefix caching is on, or when it carries a
    ``prefix_share_key`` (the children of an ``n > 1`` request share their prompt even with
    caching off). Only full blocks whose tokens are all known are hashed and registered.
    The scheduler owns ``request.num_computed_tokens``; this class only reads it.

    Forking (``fork``, beam search) gives a child request its parent's blocks with one more
    reference each. A block that more than one request holds is read-only: the first write of
    a request into a shared block (its partial last block, where sibling beams diverge) moves
    it onto a fresh copy (copy-on-write); ``take_block_copies`` hands the (source,
    destination) pairs to the step that must copy them on the device before its forward.

    With ``num_host_blocks`` a second pool in host memory takes the blocks of requests
    preempted by swap (``swap_out`` / ``swap_in``, see ``hitchllm.kv_cache.host_swap``);
    ``take_swaps`` hands the step its device <-> host copies.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        extra_keys_fn: Callable[[Request], Sequence[object] | None] | None = None,
        num_host_blocks: int = 0,
    ) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.extra_keys_fn = extra_keys_fn
        self.block_pool = BlockPool(num_blocks)
        self._blocks: dict[str, list[KVCacheBlock]] = {}
        # The same blocks as ids, kept in step so the runner's per-step read copies nothing.
        self._block_ids: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        # How many of a request's leading blocks were already offered to the prefix cache, so
        # each decode step only looks at the blocks it filled.
        self._num_registered: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Copy-on-write block copies decided since the last ``take_block_copies``.
        self._block_copies: list[tuple[int, int]] = []
        # Whether any request was forked: until then no request can write into a shared
        # block, and allocation need not look for one.
        self._forked = False
        self.host = HostSwapSpace(num_host_blocks) if num_host_blocks else None

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks available to allocate, cached-but-unused ones included."""
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests, in [0, 1]."""
        return self.block_pool.usage

    def _uses_hashing(self, request: Request) -> bool:
        return self.enable_prefix_caching or request.prefix_share_key is not None

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of every full block of ``request.all_token_ids``, extended incrementally."""
        hashes = self._hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) == num_full:
            return hashes
        every_block: tuple = (request.lora_name,)
        if self.extra_keys_fn is not None:
            # Plugin hooks hand back lists or None; normalize so equal keys hash equally.
            hook_keys = self.extra_keys_fn(request)
            every_block += (() if hook_keys is None else tuple(hook_keys),)
        # With caching on, equal content may be shared by anyone, share key or not; with it off
        # the share key is what confines sharing to one group of sibling requests.
        share_key = None if self.enable_prefix_caching else request.prefix_share_key
        first_block = (*every_block, share_key, request.cache_salt)
        tokens = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[i - 1] if i > 0 else None
            block_tokens = tokens[i * self.block_size : (i + 1) * self.block_size]
            keys = first_block if i == 0 else every_block
            hashes.append(hash_block_tokens(parent, block_tokens, keys))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Leading full prompt blocks already in the cache, and how many tokens they hold.

        The hit stops short of the whole prompt so the last prompt token is always computed
        and produces logits to sample from. Reference counts are not changed: pass the blocks
        to ``allocate_slots`` to take them.
        """
        if not self._uses_hashing(request):
            return [], 0
        max_hit_blocks = (request.num_prompt_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in self._block_hashes(request)[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        num_lookahead_tokens: int = 0,
    ) -> bool:
        """Give ``request`` blocks for its computed tokens, the hit, and the tokens to compute.

        ``new_computed_blocks`` (from ``get_computed_blocks``, only before the request holds
        any block; pass an empty list for a miss) become the first blocks and are referenced,
        and the lookup is counted in the prefix-cache stats. Returns False, changing nothing,
        when too few blocks are free; free cached blocks count as free and are evicted first.
        """
        # Runs for every scheduled request and step: the common case (a decode that fits the
        # blocks it holds) skips what it does not need.
        rid = request.request_id
        hit = new_computed_blocks or []
        blocks = self._blocks.get(rid, [])
        if hit and (blocks or request.num_computed_tokens):
            raise ValueError(
                f"request {rid}: new_computed_blocks are only valid for a "
                "request with no computed tokens and no blocks"
            )
        num_hit_tokens = len(hit) * self.block_size
        num_computed_after = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-(num_computed_after + num_lookahead_tokens) // self.block_size)
        num_new_blocks = max(0, num_needed - len(blocks) - len(hit))
        # A hit on a free cached block takes it out of the free pool too.
        num_hit_free = sum(1 for block in hit if block.ref_cnt == 0) if hit else 0
        shared = (self._shared_blocks_to_write(request, blocks)
                  if num_new_tokens and blocks and self._forked else [])
        num_taken = num_new_blocks + num_hit_free + len(shared)
        if num_taken and num_taken > self.block_pool.num_free_blocks:
            return False

        if shared:
            self._copy_on_write(request, blocks, shared)
        if hit:  # only for a request that holds no block yet
            self.block_pool.touch(hit)
            blocks = list(hit)
            self._block_ids[rid] = [b.block_id for b in hit]
        block_ids = self._block_ids.setdefault(rid, [])
        if num_new_blocks:
            new = self.block_pool.get_new_blocks(num_new_blocks)
            blocks.extend(new)
            block_ids.extend(b.block_id for b in new)
        self._blocks[rid] = blocks
        if self._uses_hashing(request):
            if new_computed_blocks is not None:
                # Counted on admission only, so a request that waits is not counted per retry.
                self.prefix_cache_queries += request.num_prompt_tokens
                self.prefix_cache_hits += num_hit_tokens
            num_known = min(num_computed_after, len(request.all_token_ids))
            if num_known // self.block_size > self._num_registered.get(rid, 0):
                self._register_full_blocks(request, num_known)
        return True

    def reserve_blocks(self, request: Request, num_tokens: int) -> bool:
        """Give ``request`` (which holds no block) fresh blocks for ``num_tokens`` tokens, for
        KV that another engine will send (disaggregated decode). They are not offered to the prefix
        cache until the request computes on (``allocate_slots``), so no other request can hit
        them before the KV is in. Returns False, changing nothing, when too few are free."""
        if request.request_id in self._blocks:
            raise ValueError(f"request {request.request_id} already holds blocks")
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.block_pool.num_free_blocks:
            return False
        blocks = self.block_pool.get_new_blocks(num_blocks)
        self._blocks[request.request_id] = blocks
        self._block_ids[request.request_id] = [b.block_id for b in blocks]
        return True

    def _shared_blocks_to_write(self, request: Request, blocks: list[KVCacheBlock]) -> list[int]:
        """Indices of the request's blocks that this step writes into and that another
        request also holds (only a fork's blocks can be: prefix-cache hits are full blocks,
        never written again)."""
        first = request.num_computed_tokens // self.block_size
        return [i for i in range(first, len(blocks)) if blocks[i].ref_cnt > 1]

    def _copy_on_write(self, request: Request, blocks: list[KVCacheBlock],
                       indices: list[int]) -> None:
        """Give the request a private copy of each shared block at ``indices``: a fresh block
        replaces it in the request's table, the shared one loses this request's reference,
        and the copy is queued for the device (``take_block_copies``)."""
        if not indices:
            return
        block_ids = self._block_ids[request.request_id]
        for i, fresh in zip(indices, self.block_pool.get_new_blocks(len(indices))):
            self._block_copies.append((blocks[i].block_id, fresh.block_id))
            self.block_pool.free_blocks([blocks[i]])  # still held by the other request(s)
            blocks[i] = fresh
            block_ids[i] = fresh.block_id

    def fork(self, parent: Request, child: Request) -> None:
        """Let ``child`` (whose tokens extend ``parent``'s) share every block of ``parent``:
        one more reference per block, no copy. The shared partial last block is copied when
        either of them first writes into it (see ``allocate_slots``)."""
        if child.request_id in self._blocks:
            raise ValueError(f"request {child.request_id} already holds blocks; fork a new "
                             "request")
        pid, cid = parent.request_id, child.request_id
        self._forked = True
        blocks = self._blocks.get(pid, [])
        self.block_pool.touch(blocks)
        self._blocks[cid] = list(blocks)
        self._block_ids[cid] = list(self._block_ids.get(pid, []))
        if pid in self._hashes:  # the parent's full blocks are a prefix of the child's
            self._hashes[cid] = list(self._hashes[pid])
        if pid in self._num_registered:
            self._num_registered[cid] = self._num_registered[pid]

    def take_block_copies(self) -> list[tuple[int, int]]:
        """The (source, destination) block copies decided since the last call, in order;
        they must run on the device before the next forward reads or writes the blocks."""
        copies, self._block_copies = self._block_copies, []
        return copies

    def _register_full_blocks(self, request: Request, num_known_tokens: int) -> None:
        """Offer the request's full blocks covering ``num_known_tokens`` to the prefix cache."""
        rid = request.request_id
        num_full = num_known_tokens // self.block_size
        start = self._num_registered.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self._blocks[rid]
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self._num_registered[rid] = num_full

    def uncache_from(self, request: Request, num_tokens: int) -> None:
        """``request``'s blocks from token ``num_tokens`` on may not hold the K/V their hashes
        promise (the step that was to write them failed or never ran): they leave the prefix
        cache, so a recompute cannot hit them."""
        rid = request.request_id
        first = num_tokens // self.block_size
        for block in self._blocks.get(rid, [])[first:]:
            self.block_pool.uncache(block)
        if self._num_registered.get(rid, 0) > first:
            self._num_registered[rid] = first

    # ---- swap preemption ----------------------------------------------------------------

    def is_swapped(self, request_id: str) -> bool:
        """Whether the request is swapped out (its KV waits in the host pool)."""
        return self.host is not None and self.host.is_swapped(request_id)

    def keeps_device_blocks(self, request_id: str) -> bool:
        """Whether the request is swapped out keeping device blocks (shared when it was
        swapped out; recomputing it frees its references)."""
        return (self.host is not None and self.host.is_swapped(request_id)
                and any(e.device is not None for e in self.host.entries(request_id)))

    def swap_out(self, request: Request) -> bool:
        """Preempt ``request`` by swap: its blocks held alone go to host blocks and are freed
        on the device, shared ones stay referenced (see ``host_swap``). Its computed tokens
        stay computed. Returns False, changing nothing, when there is no host pool or too
        few free host blocks (the caller recomputes the request instead)."""
        rid = request.request_id
        if self.host is None or not self.host.swap_out(rid, self._blocks.get(rid, []),
                                                       self.block_pool):
            return False
        self._blocks.pop(rid, None)
        self._block_ids.pop(rid, None)
        # Its hashes stay (the tokens did not change); blocks are offered to the prefix cache
        # again at swap-in, fresh device blocks among them.
        self._num_registered.pop(rid, None)
        return True

    def swap_out_size(self, request: Request) -> tuple[int, int]:
        """What a swap-out of ``request`` would cost: the blocks it would copy to the host,
        and the tokens of the blocks that stay on the device (shared with other requests),
        which a recompute would not compute again either."""
        blocks = self._blocks.get(request.request_id, [])
        kept = sum(1 for b in blocks if b.ref_cnt > 1)
        to_copy = self.host.num_blocks_to_copy(blocks) if self.host is not None else 0
        return to_copy, min(kept * self.block_size, request.num_computed_tokens)

    def swap_in(self, request: Request, num_new_tokens: int) -> bool:
        """Bring a swapped-out request's blocks back to the device and give it slots for
        ``num_new_tokens`` more tokens, as ``allocate_slots``. Returns False, changing
        nothing, when too few device blocks are free."""
        assert self.host is not None
        rid = request.request_id
        entries = self.host.entries(rid)
        num_needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        first_written = request.num_computed_tokens // self.block_size
        shared_written = sum(1 for i, e in enumerate(entries) if i >= first_written
                             and e.device is not None and e.device.ref_cnt > 1)
        need = (self.host.num_device_blocks_to_swap_in(rid, self.block_pool)
                + max(0, num_needed - len(entries)) + shared_written)
        if need > self.block_pool.num_free_blocks:
            return False
        blocks = self.host.swap_in(rid, self.block_pool)
        self._blocks[rid] = blocks
        self._block_ids[rid] = [b.block_id for b in blocks]
        if not self.allocate_slots(request, num_new_tokens):
            raise RuntimeError(f"request {rid}: swapped in but its new slots did not fit")
        return True

    def take_swaps(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The swap-out (device, host) and swap-in (host, device) block copies decided since
        the last call; the step runs them before its forward (swap-outs first)."""
        return ([], []) if self.host is None else self.host.take_copies()

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host is None else self.host.num_blocks

    @property
    def num_free_host_blocks(self) -> int:
        """Host blocks no swapped-out request holds (cached ones included)."""
        return 0 if self.host is None else self.host.pool.num_free_blocks

    def free(self, request: Request) -> None:
        """Release the request's blocks (device, and host when it is swapped out) and forget
        it; a no-op for an unknown request."""
        rid = request.request_id
        if self.host is not None:
            self.host.discard(rid, self.block_pool)
        blocks = self._blocks.pop(rid, [])
        self._block_ids.pop(rid, None)
        # Tail first: a prompt's last blocks are the least likely to be hit again.
        self.block_pool.free_blocks(reversed(blocks))
        self._hashes.pop(rid, None)
        self._num_registered.pop(rid, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Physical block ids of the request, in token order (its block table row).

        The manager's own list, returned without copying: read it, do not change it.
        """
        return self._block_ids.get(request_id, [])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash, in the host pool too (its blocks would otherwise
        stand in for content computed anew); only succeeds while no request holds a block."""
        host = self.host.pool if self.host is not None else None
        if host is not None and host.num_free_blocks != host.num_blocks:
            return False
        return self.block_pool.reset_prefix_cache() and (
            host is None or host.reset_prefix_cache())
