"""Copy-on-write's device copy: for every installed attention backend's cache layout, the
block dimension is found from its shape and ``copy_blocks`` copies exactly the named blocks
(every head, slot and K/V half) and touches nothing else."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from hitchllm.attention import KVCacheKind, KVCacheSpec
from hitchllm.attention.block_copy import block_dim, copy_blocks
from hitchllm.plugins import get_plugin_registry

NUM_BLOCKS = 6


def installed_backends() -> dict:
    """Every installed attention backend by name."""
    found = {}
    for result in get_plugin_registry().hook.hitchllm_attention_backends():
        for backend in result or []:
            found[backend.name] = backend
    return found


BACKENDS = installed_backends()


def spec_for(backend, dtype=torch.float32) -> KVCacheSpec:
    """A small cache spec of the kind ``backend`` serves (MLA latent or full attention)."""
    if "MLA" in backend.name:
        return KVCacheSpec(KVCacheKind.MLA_LATENT, 1, 24, dtype, 4)
    return KVCacheSpec(KVCacheKind.FULL_ATTENTION, 2, 8, dtype, 4)


@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_copy_blocks_copies_exactly_the_named_blocks(name):
    backend = BACKENDS[name]
    spec = spec_for(backend)
    dim = block_dim(backend, spec)
    caches = [torch.randn(backend.get_kv_cache_shape_for_spec(NUM_BLOCKS, spec))
              for _ in range(2)]
    before = [c.clone() for c in caches]
    copy_blocks(caches, [dim, dim], [(1, 4), (3, 0)])
    for cache, old in zip(caches, before):
        assert torch.equal(cache.select(dim, 4), old.select(dim, 1))
        assert torch.equal(cache.select(dim, 0), old.select(dim, 3))
        for untouched in (1, 2, 3, 5):
            assert torch.equal(cache.select(dim, untouched), old.select(dim, untouched))


def test_fp8_caches_are_copied_as_bytes():
    backend = BACKENDS["TORCH"]
    spec = spec_for(backend, torch.float8_e4m3fn)
    dim = block_dim(backend, spec)
    cache = torch.randn(backend.get_kv_cache_shape_for_spec(NUM_BLOCKS, spec)).to(
        torch.float8_e4m3fn)
    old = cache.view(torch.uint8).clone()
    copy_blocks([cache], [dim], [(2, 5)])
    assert torch.equal(cache.view(torch.uint8).select(dim, 5), old.select(dim, 2))




def test_the_runner_loads_nothing_of_the_scheduler_side_at_run_time():
    """The device copy lives beside the attention backends: importing the model runner (as a
    worker process does) loads neither requests nor the KV cache manager."""
    code = ("import sys, hitchllm.engine.model_runner; "
            "print(sorted(m for m in ('hitchllm.request', 'hitchllm.kv_cache.manager', "
            "'hitchllm.scheduler.scheduler') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]"
