"""The runner's swap copies: for every installed backend's cache layout (block dimension 0, 1
or 2, MLA latent caches) and for fp8 caches, a block swapped out and back in lands exactly
where the plan says, bit for bit, and nothing else changes."""

from __future__ import annotations

import pytest
import torch
from test_attention_block_copy import BACKENDS, spec_for

from hitchllm.attention.block_copy import block_dim
from hitchllm.engine.kv_swap import HostKVCache, _runs, host_pool_blocks, host_pool_bytes

NUM_BLOCKS = 7
NUM_HOST_BLOCKS = 5


def _round_trip(backend, dtype: torch.dtype, device: torch.device) -> None:
    spec = spec_for(backend, dtype)
    dim = block_dim(backend, spec)
    shape = backend.get_kv_cache_shape_for_spec(NUM_BLOCKS, spec)
    caches = [torch.randn(shape, device=device).to(dtype) for _ in range(2)]
    host = HostKVCache(backend, [spec, spec], caches, [dim, dim], NUM_HOST_BLOCKS, device)
    raw = [c.view(torch.uint8) if c.element_size() == 1 else c for c in caches]
    before = [r.clone() for r in raw]
    # Device blocks 1, 2 (a run) and 5 go to host blocks 3, 4 and 0.
    host.swap([(1, 3), (2, 4), (5, 0)], [], set())
    host.swap([], [], set())  # the next step: it may write the blocks swapped out
    for r in raw:
        r.select(dim, 1).zero_()
        r.select(dim, 2).zero_()
        r.select(dim, 5).zero_()
    # Back into other device blocks: host 3 -> 6, 0 -> 1, 4 -> 2.
    host.swap([], [(3, 6), (0, 1), (4, 2)], set())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    for r, old in zip(raw, before):
        assert torch.equal(r.select(dim, 6), old.select(dim, 1))
        assert torch.equal(r.select(dim, 1), old.select(dim, 5))
        assert torch.equal(r.select(dim, 2), old.select(dim, 2))
        for untouched in (0, 3, 4):
            assert torch.equal(r.select(dim, untouched), old.select(dim, untouched))
        assert not r.select(dim, 5).any()


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_a_swapped_block_comes_back_bit_for_bit(name):
    _round_trip(BACKENDS[name], torch.float32, torch.device("cpu"))


def test_fp8_caches_are_swapped_as_bytes():
    _round_trip(BACKENDS["TORCH"], torch.float8_e4m3fn, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_swaps_on_the_side_stream_round_trip(name, dtype):
    _round_trip(BACKENDS[name], dtype, torch.device("cuda"))


def test_runs_of_consecutive_host_blocks():
    assert _runs([0, 3, 4, 5, 7]) == [(0, 0, 1), (3, 1, 3), (7, 4, 1)]
    assert _runs([]) == []


@pytest.mark.gpu
def test_cuda_swaps_never_sync_and_wait_only_when_needed():
    """The copies are queued on the side stream without a host sync; a swap-out whose blocks
    this step does not write is left for the next step to wait on, one it reuses (or any
    swap-in) is waited on at once."""
    backend = BACKENDS["TORCH"]
    spec = spec_for(backend)
    dim = block_dim(backend, spec)
    device = torch.device("cuda")
    cache = torch.randn(backend.get_kv_cache_shape_for_spec(NUM_BLOCKS, spec), device=device)
    host = HostKVCache(backend, [spec], [cache], [dim], NUM_HOST_BLOCKS, device)
    assert host.host_caches[0].is_pinned()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        host.swap([(1, 0)], [], written={4})
        assert host._unwaited is not None  # overlaps this step's forward
        host.swap([], [], written=set())  # the next step waits for it
        assert host._unwaited is None
        host.swap([(2, 1)], [], written={2})
        assert host._unwaited is None  # reused at once: waited on
        host.swap([], [(0, 3)], written=set())
        assert host._unwaited is None
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(cache.select(dim, 3), cache.select(dim, 1))


def test_host_pool_sizing_fits_the_budget_with_the_layouts_spare_block():
    backend = BACKENDS["TORCH"]  # holds a spare block per layer
    specs = [spec_for(backend)] * 3
    per_block = 3 * specs[0].bytes_per_block
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    # 10 blocks' bytes give 9 blocks: the spare block takes one.
    assert host_pool_blocks(backend, specs, 10 * per_block, cpu) == 9
    assert host_pool_bytes(backend, specs, 9) == 10 * per_block
    # Pinned (CUDA) pools round the budget down to a power of two: never more than asked.
    budget = 3 * 2**20
    n = host_pool_blocks(backend, specs, budget, cuda)
    assert host_pool_bytes(backend, specs, n) <= 2**21 < host_pool_bytes(backend, specs, n + 1)
    assert host_pool_blocks(backend, specs, per_block, cpu) == 0
