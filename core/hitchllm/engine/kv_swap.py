"""The host half of swap preemption on one rank: a host copy of every layer's KV cache with
``num_host_blocks`` blocks (pinned memory on CUDA, a second CPU tensor on the CPU), and the
block copies between it and the device caches that a step plan asks for.

Each host tensor has its layer's device layout with fewer blocks, so a block is the same
slices on both sides whatever the backend's layout (block dimension 0, 1 or 2; an MLA latent
cache; an fp8 cache, copied as bytes). The tensor is cut into pieces along the dimensions
before the block dimension (K and V, or each KV head), in each of which a block is one
contiguous range. On CUDA the device side of a swap is one gather (or scatter) kernel per
piece into a contiguous staging tensor, and the host side one copy per run of consecutive
host blocks.

On CUDA the copies run on a side stream, after the work already queued on the compute stream
(the previous step wrote the blocks being swapped out). The forward waits for them only when
it needs them: at once when the step swaps blocks in or reuses a block it swapped out, else
before the next step's work (which may reuse them).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence

import torch

from hitchllm.attention.backend import AttentionBackend
from hitchllm.attention.kv_cache_spec import KVCacheSpec


def _pieces(cache: torch.Tensor, dim: int) -> list[torch.Tensor]:
    """Views of ``cache`` with the block dimension first, one per index of the dimensions
    before it; each is contiguous when ``cache`` is."""
    raw = cache.view(torch.uint8) if cache.element_size() == 1 else cache
    return [raw[index] for index in itertools.product(*map(range, raw.shape[:dim]))]


def _runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(first id, index, n)`` for each run of consecutive ids in ``ids`` (sorted): ``n``
    blocks from ``first id`` on, at ``index`` in ``ids``."""
    runs: list[list[int]] = []
    for index, block in enumerate(ids):
        if runs and block == runs[-1][0] + runs[-1][2]:
            runs[-1][2] += 1
        else:
            runs.append([block, index, 1])
    return [(b, i, n) for b, i, n in runs]


_ALIGN = 256


def host_pool_bytes(backend: type[AttentionBackend], specs: Sequence[KVCacheSpec],
                    num_blocks: int) -> int:
    """Bytes of a host pool of ``num_blocks`` blocks: every layer's tensor in its backend's
    layout (which may hold a spare block)."""
    return sum(_aligned(math.prod(backend.get_kv_cache_shape_for_spec(num_blocks, s))
                        * s.dtype.itemsize) for s in specs)


def _aligned(size: int) -> int:
    """``size`` rounded up so that every layer's tensor in the one buffer starts aligned."""
    return -(-size // _ALIGN) * _ALIGN


def host_pool_blocks(backend: type[AttentionBackend], specs: Sequence[KVCacheSpec],
                     budget: int, device: torch.device) -> int:
    """The most host blocks whose pool fits in ``budget`` bytes. On CUDA the pool is pinned,
    and PyTorch's pinned allocator rounds an allocation up to a power of two: the budget is
    rounded down to one, so the pool never takes more than asked (``swap_space=4`` is 4 GiB,
    ``6`` is also 4)."""
    if device.type == "cuda" and budget > 0:
        budget = 1 << (budget.bit_length() - 1)
    per_block = sum(s.bytes_per_block for s in specs)
    num_blocks = budget // per_block
    while num_blocks > 0 and host_pool_bytes(backend, specs, num_blocks) > budget:
        over = host_pool_bytes(backend, specs, num_blocks) - budget
        num_blocks -= max(1, -(-over // per_block))
    return max(num_blocks, 0)


class HostKVCache:
    """Every layer's host pool and the swaps between it and the device caches."""

    def __init__(self, backend: type[AttentionBackend], specs: Sequence[KVCacheSpec],
                 device_caches: Sequence[torch.Tensor], block_dims: Sequence[int],
                 num_host_blocks: int, device: torch.device) -> None:
        self.device = device
        self.num_blocks = num_host_blocks
        # One buffer carved into the layers' tensors: PyTorch's pinned allocator rounds each
        # allocation up to a power of two (see ``host_pool_blocks``).
        shapes = [backend.get_kv_cache_shape_for_spec(num_host_blocks, s) for s in specs]
        sizes = [math.prod(shape) * spec.dtype.itemsize for shape, spec in zip(shapes, specs)]
        self._buffer = torch.zeros(sum(map(_aligned, sizes)), dtype=torch.uint8,
                                   pin_memory=device.type == "cuda")
        offsets = itertools.accumulate(map(_aligned, sizes), initial=0)
        self.host_caches = [
            self._buffer[start:start + size].view(spec.dtype).view(shape)
            for start, size, shape, spec in zip(offsets, sizes, shapes, specs)
        ]
        self._device_pieces = [p for cache, dim in zip(device_caches, block_dims, strict=True)
                               for p in _pieces(cache, dim)]
        self._host_pieces = [p for cache, dim in zip(self.host_caches, block_dims, strict=True)
                             for p in _pieces(cache, dim)]
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        # Swap-outs of the last step that the compute stream has not waited for yet.
        self._unwaited: torch.cuda.Event | None = None

    def swap(self, swap_out: Sequence[tuple[int, int]], swap_in: Sequence[tuple[int, int]],
             written: set[int]) -> None:
        """Copy ``swap_out`` (device -> host) then ``swap_in`` (host -> device) blocks.
        ``written``: the device blocks this step writes or reads anew (its new blocks and
        copy-on-write destinations); the forward waits for the swap-outs when they reuse one."""
        if self.stream is None:
            self._copy(swap_out, swap_in)
            return
        compute = torch.cuda.current_stream(self.device)
        if self._unwaited is not None:
            # The last step's swapped-out blocks may be written from this step on.
            compute.wait_event(self._unwaited)
            self._unwaited = None
        if not swap_out and not swap_in:
            return
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            self._copy(swap_out, swap_in)
        done = torch.cuda.Event()
        done.record(self.stream)
        if swap_in or any(src in written for src, _ in swap_out):
            compute.wait_event(done)
        else:
            self._unwaited = done

    def _copy(self, swap_out: Sequence[tuple[int, int]],
              swap_in: Sequence[tuple[int, int]]) -> None:
        """Per piece of every layer: on the CPU one gather and one scatter; on CUDA one gather
        (or scatter) kernel on the device side, and one copy per run of consecutive host
        blocks, pairs sorted by host block (freed host blocks come back in runs)."""
        cuda = self.stream is not None
        if swap_out:
            pairs = sorted(swap_out, key=lambda p: p[1])
            src = self._index([d for d, _ in pairs], self.device)
            dst = [h for _, h in pairs]
            runs = _runs(dst)
            host_dst = None if cuda else self._index(dst, self.device)
            for dev, host in zip(self._device_pieces, self._host_pieces):
                staged = dev.index_select(0, src)
                if host_dst is not None:
                    host.index_copy_(0, host_dst, staged)
                    continue
                for block, i, n in runs:
                    host[block:block + n].copy_(staged[i:i + n], non_blocking=True)
        if swap_in:
            pairs = sorted(swap_in)
            src = [h for h, _ in pairs]
            dst = self._index([d for _, d in pairs], self.device)
            runs = _runs(src)
            host_src = None if cuda else self._index(src, self.device)
            for dev, host in zip(self._device_pieces, self._host_pieces):
                if host_src is not None:
                    dev.index_copy_(0, dst, host.index_select(0, host_src))
                    continue
                staged = torch.empty((len(pairs), *dev.shape[1:]), dtype=dev.dtype,
                                     device=self.device)
                for block, i, n in runs:
                    staged[i:i + n].copy_(host[block:block + n], non_blocking=True)
                dev.index_copy_(0, dst, staged)

    @staticmethod
    def _index(ids: list[int], device: torch.device) -> torch.Tensor:
        index = torch.tensor(ids, dtype=torch.int64)
        if device.type != "cuda":
            return index
        return index.pin_memory().to(device, non_blocking=True)

    def measure_seconds_per_block(self, num_device_blocks: int) -> float:
        """Seconds to swap one block out and back in, timed over up to 64 blocks (after a
        warm-up round); the blocks' contents are unchanged."""
        n = min(64, self.num_blocks, num_device_blocks)
        pairs = [(i, i) for i in range(n)]
        elapsed = 0.0
        for _ in range(2):
            self._sync()
            start = time.perf_counter()
            self.swap(pairs, [], set())
            self.swap([], pairs, set())
            self._sync()
            elapsed = time.perf_counter() - start
        return elapsed / n

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
