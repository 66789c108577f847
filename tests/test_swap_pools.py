"""The two block pools under random operations (hypothesis): admissions with prefix-cache hits,
steps, forks (copy-on-write), swap-outs, swap-ins and frees on a small device pool and a
smaller host pool.

An independent model of the caches' contents follows every copy the manager hands out (swap
out, swap in, copy-on-write, applied in the runner's order) and every token a step writes;
after each operation every computed token of every request must be readable where its block
table points, reference counts must equal the holders, and at the end both pools are free."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.request import Request
from hitchllm.sampling_params import SamplingParams

BLOCK = 2
DEVICE_BLOCKS = 8
HOST_BLOCKS = 6
PREFIXES = ([1, 2, 3, 4], [1, 2, 3, 5], [9, 8])

# Adds and steps fill the device pool, so that blocks swapped out are evicted there before
# they come back in.
OP_NAMES = ["add", "add", "step", "step", "fork", "out", "out", "in", "in", "free"]
OPS = st.lists(st.tuples(st.sampled_from(OP_NAMES),
                         st.integers(0, 50), st.integers(1, 4)), max_size=80)


class Model:
    """The manager under test and what the cache would hold."""

    def __init__(self, caching: bool) -> None:
        self.kv = KVCacheManager(DEVICE_BLOCKS, BLOCK, caching, num_host_blocks=HOST_BLOCKS)
        self.device: dict[int, list] = {}
        self.host: dict[int, list] = {}
        self.running: list[Request] = []
        self.swapped: list[Request] = []
        self.count = 0

    def apply_copies(self) -> None:
        out, into = self.kv.take_swaps()
        for d, h in out:
            self.host[h] = list(self.device.get(d, [None] * BLOCK))
        for h, d in into:
            self.device[d] = list(self.host[h])
        for s, d in self.kv.take_block_copies():
            self.device[d] = list(self.device.get(s, [None] * BLOCK))

    def write(self, request: Request, start: int, end: int) -> None:
        table = self.kv.get_block_ids(request.request_id)
        for pos in range(start, end):
            block = self.device.setdefault(table[pos // BLOCK], [None] * BLOCK)
            block[pos % BLOCK] = request.all_token_ids[pos]

    def check(self) -> None:
        for request in self.running:
            table = self.kv.get_block_ids(request.request_id)
            for pos in range(request.num_computed_tokens):
                got = self.device.get(table[pos // BLOCK], [None] * BLOCK)[pos % BLOCK]
                assert got == request.all_token_ids[pos], (request.request_id, pos)
        holders: dict[int, int] = {}
        host_holders: dict[int, int] = {}
        for request in self.running:
            for b in self.kv._blocks.get(request.request_id, []):
                holders[b.block_id] = holders.get(b.block_id, 0) + 1
        for request in self.swapped:
            for entry in self.kv.host.entries(request.request_id):
                if entry.device is not None:
                    holders[entry.device.block_id] = holders.get(entry.device.block_id, 0) + 1
                else:
                    host_holders[entry.host.block_id] = host_holders.get(
                        entry.host.block_id, 0) + 1
        for block in self.kv.block_pool.blocks:
            assert block.ref_cnt == holders.get(block.block_id, 0)
        for block in self.kv.host.pool.blocks:
            assert block.ref_cnt == host_holders.get(block.block_id, 0)
        assert self.kv.num_free_blocks == sum(
            b.ref_cnt == 0 for b in self.kv.block_pool.blocks)

    def new_tokens(self, request: Request, n: int) -> int:
        """Tokens to compute next (a decode's new token is sampled first when all are)."""
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(100 + request.num_tokens)
        return min(n, request.num_tokens - request.num_computed_tokens)

    def op(self, name: str, pick: int, n: int) -> None:
        if name == "add":
            self.count += 1
            tokens = PREFIXES[pick % len(PREFIXES)] + [50 + pick] * (pick // 3 % 5)
            request = Request(str(self.count), tokens, SamplingParams())
            hit, num_hit = self.kv.get_computed_blocks(request)
            num_new = min(n, request.num_tokens - num_hit)
            if self.kv.allocate_slots(request, num_new, hit):
                request.num_computed_tokens = num_hit
                self.write(request, num_hit, num_hit + num_new)
                request.num_computed_tokens += num_new
                self.running.append(request)
            return
        if name == "step" and self.running:
            request = self.running[pick % len(self.running)]
            num_new = self.new_tokens(request, n)
            if self.kv.allocate_slots(request, num_new):
                self.apply_copies()
                start = request.num_computed_tokens
                self.write(request, start, start + num_new)
                request.num_computed_tokens += num_new
            return
        if name == "fork" and self.running:
            parent = self.running[pick % len(self.running)]
            self.count += 1
            child = Request(str(self.count), parent.prompt_token_ids, SamplingParams())
            for token in parent.output_token_ids:
                child.append_output_token(token)
            self.kv.fork(parent, child)
            child.num_computed_tokens = parent.num_computed_tokens
            self.running.append(child)
            return
        if name == "out" and self.running:
            request = self.running.pop(pick % len(self.running))
            if self.kv.swap_out(request):
                self.swapped.append(request)
            else:  # recompute: its blocks go
                self.kv.free(request)
            return
        if name == "in" and self.swapped:
            request = self.swapped[pick % len(self.swapped)]
            num_new = self.new_tokens(request, n)
            if self.kv.swap_in(request, num_new):
                self.swapped.remove(request)
                self.running.append(request)
                self.apply_copies()
                start = request.num_computed_tokens
                self.write(request, start, start + num_new)
                request.num_computed_tokens += num_new
            return
        if name == "free":
            pool = self.running + self.swapped
            if pool:
                request = pool[pick % len(pool)]
                self.kv.free(request)
                (self.running if request in self.running else self.swapped).remove(request)


def run_and_drain(model: Model, ops) -> None:
    """Apply ``ops`` (name, pick, n), checking both pools after each; then free every request
    and check that both pools are whole."""
    for name, pick, n in ops:
        model.op(name, pick, n)
        model.apply_copies()
        model.check()
    for request in model.running + model.swapped:
        model.kv.free(request)
    assert model.kv.num_free_blocks == DEVICE_BLOCKS
    assert model.kv.num_free_host_blocks == HOST_BLOCKS


@settings(max_examples=300, deadline=None)
@given(ops=OPS, caching=st.booleans())
def test_two_pools_keep_contents_and_counts(ops, caching):
    run_and_drain(Model(caching), ops)


def test_two_pools_under_a_seeded_random_sweep():
    """Many more (unshrunk) operation sequences than hypothesis tries: blocks evicted on the
    device between their swap-out and swap-in happen only in some."""
    rng = random.Random(20)
    for _ in range(400):
        ops = [(rng.choice(OP_NAMES), rng.randrange(51), rng.randrange(1, 5))
               for _ in range(rng.randrange(100))]
        run_and_drain(Model(rng.random() < 0.7), ops)


def test_a_cached_block_is_swapped_out_once():
    """Two requests holding the same prefix content in turn: the second swap-out finds it in
    the host pool and copies nothing more."""
    model = Model(caching=True)
    model.op("add", 0, 4)  # request 1: [1, 2, 3, 4], both blocks computed and cached
    assert model.kv.swap_out(model.running[0])
    out, _ = model.kv.take_swaps()
    assert len(out) == 2
    model.swapped.append(model.running.pop())
    model.op("add", 3, 4)  # request 2: [1, 2, 3, 4, 53], hits both blocks
    request = model.running[0]
    assert request.num_computed_tokens == 5
    assert model.kv.swap_out(request)
    out, _ = model.kv.take_swaps()
    # Only its partial third block is copied: its two full blocks already sit in host memory.
    entries = model.kv.host.entries(request.request_id)
    assert [h for _, h in out] == [entries[2].host.block_id]
    assert model.kv.num_free_host_blocks == HOST_BLOCKS - 3


def test_resetting_the_prefix_cache_forgets_host_hashes_too():
    model = Model(caching=True)
    model.op("add", 0, 4)
    request = model.running.pop()
    assert model.kv.swap_out(request)
    assert not model.kv.reset_prefix_cache()  # a swapped-out request holds host blocks
    model.kv.free(request)
    assert any(b.block_hash is not None for b in model.kv.host.pool.blocks)
    assert model.kv.reset_prefix_cache()
    assert all(b.block_hash is None for b in model.kv.host.pool.blocks)
