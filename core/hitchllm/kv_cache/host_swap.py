"""Swap preemption's bookkeeping: a second block pool in host memory and the block tables of
swapped-out requests.

A request preempted by swap keeps its computed tokens: each KV block it holds *alone* is
copied to a host block and freed on the device; when it resumes, each host block is copied
back to a fresh device block. The copies themselves are the runner's; this module decides
them and hands them out as ``(source, destination)`` block-id pairs (``take_copies``).

Shared blocks are never copied:

- A device block another request also holds (a prefix shared with running requests, a
  forked beam's blocks) stays on the device and the swapped-out request keeps its reference.
  Dropping it would free nothing (the block is in use), and keeping it means the block is
  still there when the request resumes.
- A full block registered in the prefix cache is copied at most once: the host pool keeps
  its own hash map, and a block whose hash is already there (another swapped-out request, or
  an earlier swap, left the same content in host memory) takes one more reference on that
  host block instead of a second copy. On resume, a hashed block still cached on the device
  is reused there, with no copy in.

Host blocks are reference-counted like device blocks (``BlockPool``), so a host block freed
at swap-in keeps its hash and content until it is reused, and both pools return to fully
free when every request is gone.
"""

from __future__ import annotations

from dataclasses import dataclass

from hitchllm.kv_cache.block_pool import BlockPool, KVCacheBlock


@dataclass
class SwappedBlock:
    """One entry of a swapped-out request's block table: exactly one of ``device`` (a block
    kept on the device, still referenced by the request) and ``host`` (its copy in host
    memory) is set."""

    device: KVCacheBlock | None = None
    host: KVCacheBlock | None = None


class HostSwapSpace:
    """The host block pool and which requests are swapped out to it."""

    def __init__(self, num_host_blocks: int) -> None:
        self.pool = BlockPool(num_host_blocks)
        self._swapped: dict[str, list[SwappedBlock]] = {}
        # Decided since the last ``take_copies``: (device, host) and (host, device) pairs.
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self.num_swap_outs = 0
        self.num_swap_ins = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_used_blocks(self) -> int:
        """Host blocks held by swapped-out requests."""
        return self.pool.num_blocks - self.pool.num_free_blocks

    def is_swapped(self, request_id: str) -> bool:
        return request_id in self._swapped

    def entries(self, request_id: str) -> list[SwappedBlock]:
        """The swapped-out request's block table (read it, do not change it)."""
        return self._swapped[request_id]

    def num_blocks_to_copy(self, blocks: list[KVCacheBlock]) -> int:
        """Host blocks a swap-out of ``blocks`` (a request's table) would newly fill."""
        return sum(1 for b in blocks if b.ref_cnt == 1 and not self._host_hit(b))

    def _host_hit(self, block: KVCacheBlock) -> KVCacheBlock | None:
        if block.block_hash is None:
            return None
        return self.pool.get_cached_block(block.block_hash)

    def swap_out(self, request_id: str, blocks: list[KVCacheBlock],
                 device_pool: BlockPool) -> bool:
        """Move the request's blocks held alone to host blocks and free them on the device;
        shared ones stay (see the module doc). Returns False, changing nothing, when the host
        pool has too few free blocks."""
        if request_id in self._swapped:
            raise ValueError(f"request {request_id} is already swapped out")
        # A hit on a free cached host block takes it out of the free blocks too.
        needed = sum(1 for b in blocks if b.ref_cnt == 1
                     and ((hit := self._host_hit(b)) is None or hit.ref_cnt == 0))
        if needed > self.pool.num_free_blocks:
            return False
        entries = [SwappedBlock(device=b) if b.ref_cnt > 1 else SwappedBlock()
                   for b in blocks]
        # Hits first: taking fresh host blocks may evict a free cached one we would hit.
        for entry, block in zip(entries, blocks):
            if entry.device is None and (hit := self._host_hit(block)) is not None:
                self.pool.touch([hit])
                entry.host = hit
        fresh = iter(self.pool.get_new_blocks(
            sum(1 for e in entries if e.device is None and e.host is None)))
        released = []
        for entry, block in zip(entries, blocks):
            if entry.device is not None:
                continue
            if entry.host is None:
                entry.host = next(fresh)
                if block.block_hash is not None:
                    self.pool.cache_block(entry.host, block.block_hash)
                self._swap_out.append((block.block_id, entry.host.block_id))
            released.append(block)
        device_pool.free_blocks(reversed(released))
        self._swapped[request_id] = entries
        self.num_swap_outs += 1
        return True

    def num_device_blocks_to_swap_in(self, request_id: str, device_pool: BlockPool) -> int:
        """Free device blocks a swap-in of the request takes: a fresh block per host block
        whose content the device cache no longer holds, and each free cached block reused."""
        n = 0
        for entry in self._swapped[request_id]:
            if entry.host is None:
                continue
            hit = self._device_hit(entry.host, device_pool)
            n += hit is None or hit.ref_cnt == 0
        return n

    @staticmethod
    def _device_hit(host: KVCacheBlock, device_pool: BlockPool) -> KVCacheBlock | None:
        if host.block_hash is None:
            return None
        return device_pool.get_cached_block(host.block_hash)

    def swap_in(self, request_id: str, device_pool: BlockPool) -> list[KVCacheBlock]:
        """The request's device block table again: kept blocks as they are, hashed blocks
        still cached on the device reused, the others copied into fresh device blocks. The
        caller checked ``num_device_blocks_to_swap_in`` against the free device blocks."""
        entries = self._swapped.pop(request_id)
        table: list[KVCacheBlock | None] = [e.device for e in entries]
        for i, entry in enumerate(entries):
            if entry.host is not None and (hit := self._device_hit(entry.host, device_pool)):
                device_pool.touch([hit])
                table[i] = hit
        missing = [i for i, block in enumerate(table) if block is None]
        for i, fresh in zip(missing, device_pool.get_new_blocks(len(missing))):
            host = entries[i].host
            assert host is not None
            self._swap_in.append((host.block_id, fresh.block_id))
            table[i] = fresh
        self.pool.free_blocks(reversed([e.host for e in entries if e.host is not None]))
        self.num_swap_ins += 1
        return [b for b in table if b is not None]

    def discard(self, request_id: str, device_pool: BlockPool) -> None:
        """Forget a swapped-out request that ends (abort, stop): free its host blocks and
        its references on kept device blocks."""
        entries = self._swapped.pop(request_id, None)
        if entries is None:
            return
        device_pool.free_blocks(reversed([e.device for e in entries if e.device is not None]))
        self.pool.free_blocks(reversed([e.host for e in entries if e.host is not None]))

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The swap-out (device, host) and swap-in (host, device) copies decided since the
        last call, each in order."""
        out, self._swap_out = self._swap_out, []
        into, self._swap_in = self._swap_in, []
        return out, into
