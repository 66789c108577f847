"""Properties of the KV cache block pool, block hashes, and the KV cache manager."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hitchllm.kv_cache.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from hitchllm.kv_cache.hashing import hash_block_tokens
from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.request import Request
from hitchllm.sampling_params import SamplingParams


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    cache_salt: str | None = None,
    prefix_share_key: str | None = None,
    lora_name: str | None = None,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(),
        cache_salt=cache_salt,
        prefix_share_key=prefix_share_key,
        # Request reads the adapter name off whatever the caller passed as lora_request.
        lora_request=None if lora_name is None else SimpleNamespace(lora_name=lora_name),
    )


def admit(manager: KVCacheManager, request: Request) -> int:
    """Schedule the whole prompt in one step, as a scheduler would; returns the hit tokens."""
    hit, num_hit_tokens = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit_tokens
    assert manager.allocate_slots(request, num_new, hit)
    request.num_computed_tokens = num_hit_tokens + num_new
    return num_hit_tokens


# ---------------------------------------------------------------------------------------------
# FreeBlockQueue


@settings(max_examples=100, deadline=None)
@given(
    num_blocks=st.integers(0, 8),
    ops=st.lists(
        st.tuples(st.sampled_from(["popleft", "remove", "append"]), st.integers(0, 1000)),
        max_size=40,
    ),
)
def test_free_block_queue_matches_list_model(num_blocks: int, ops: list[tuple[str, int]]) -> None:
    """popleft / remove-from-the-middle / append act exactly like the same ops on a list."""
    blocks = [KVCacheBlock(block_id=i) for i in range(num_blocks)]
    queue = FreeBlockQueue(blocks)
    model = list(blocks)
    outside: list[KVCacheBlock] = []
    for op, k in ops:
        if op == "popleft":
            if model:
                block = queue.popleft()
                assert block is model.pop(0)
                outside.append(block)
            else:
                with pytest.raises(IndexError):
                    queue.popleft()
        elif op == "remove" and model:
            block = model.pop(k % len(model))
            queue.remove(block)
            outside.append(block)
        elif op == "append" and outside:
            block = outside.pop(k % len(outside))
            queue.append(block)
            model.append(block)
        assert [b.block_id for b in queue] == [b.block_id for b in model]
        assert len(queue) == len(model)
        assert all(b in queue for b in model)
        assert not any(b in queue for b in outside)


def test_free_block_queue_rejects_double_append_and_foreign_remove() -> None:
    """Misuse fails loudly instead of corrupting the links."""
    a, b = KVCacheBlock(block_id=0), KVCacheBlock(block_id=1)
    queue = FreeBlockQueue([a])
    with pytest.raises(ValueError):
        queue.append(a)
    with pytest.raises(ValueError):
        queue.remove(b)
    assert [blk.block_id for blk in queue] == [0]


# ---------------------------------------------------------------------------------------------
# Block hashes

_HASH_SNIPPET = (
    "from hitchllm.kv_cache.hashing import hash_block_tokens as h\n"
    "p = h(None, [1, 2, 3, 2**40], ('salt', 7, None, ('lora', True)))\n"
    "print(h(p, [4, 5, -1], ('adapter', 1.5, b'x')).hex())\n"
)


def test_block_hash_is_identical_in_another_process() -> None:
    """A fresh interpreter with a different PYTHONHASHSEED computes the same chained hash."""
    parent = hash_block_tokens(None, [1, 2, 3, 2**40], ("salt", 7, None, ("lora", True)))
    expected = hash_block_tokens(parent, [4, 5, -1], ("adapter", 1.5, b"x")).hex()
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _HASH_SNIPPET], capture_output=True, text=True, env=env, check=True
    )
    assert out.stdout.strip() == expected


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**31), min_size=1, max_size=8),
    other_tokens=st.lists(st.integers(0, 2**31), min_size=1, max_size=8),
    key=st.one_of(st.none(), st.integers(), st.text(max_size=4)),
    other_key=st.one_of(st.none(), st.integers(), st.text(max_size=4)),
)
def test_block_hash_differs_when_any_input_differs(
    tokens: list[int], other_tokens: list[int], key: object, other_key: object
) -> None:
    """Hashes are equal exactly when parent, tokens and extra keys are all equal."""
    base = hash_block_tokens(None, tokens, (key,))
    assert base == hash_block_tokens(None, list(tokens), (key,))
    assert (base == hash_block_tokens(None, other_tokens, (key,))) == (tokens == other_tokens)
    same_key = type(key) is type(other_key) and key == other_key
    assert (base == hash_block_tokens(None, tokens, (other_key,))) == same_key
    assert base != hash_block_tokens(base, tokens, (key,))
    assert hash_block_tokens(base, tokens) != hash_block_tokens(
        hash_block_tokens(None, tokens, ("other-parent",)), tokens
    )


def test_block_hash_keeps_look_alike_keys_apart() -> None:
    """1 vs "1", None vs "None", True vs 1 and nesting are all distinct extra keys."""
    keys: list[tuple] = [(1,), ("1",), (None,), ("None",), (True,), ((1,),), (1, None), ()]
    hashes = {hash_block_tokens(None, [0], k) for k in keys}
    assert len(hashes) == len(keys)
    with pytest.raises(TypeError):
        hash_block_tokens(None, [0], (object(),))


# ---------------------------------------------------------------------------------------------
# BlockPool


def test_block_pool_get_new_blocks_fails_without_enough_free_blocks() -> None:
    """Asking for more blocks than are free raises and takes nothing."""
    pool = BlockPool(3)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert pool.usage == pytest.approx(2 / 3)


def test_block_pool_duplicate_hash_keeps_first_block() -> None:
    """Registering a hash twice keeps the first block; evicting the duplicate keeps the entry."""
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(a, h)
    pool.cache_block(b, h)
    assert pool.get_cached_block(h) is a
    assert b.block_hash is None
    pool.free_blocks([b, a])
    assert pool.get_new_blocks(1) == [b]
    assert pool.get_cached_block(h) is a
    assert pool.get_new_blocks(1) == [a]
    assert pool.get_cached_block(h) is None and a.block_hash is None


def test_block_pool_reset_prefix_cache_only_when_all_free() -> None:
    """Resetting refuses while a block is in use and afterwards no hash can be hit."""
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [1, 2])
    pool.cache_block(block, h)
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is block
    pool.free_blocks([block])
    assert pool.get_cached_block(h) is block
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and block.block_hash is None


# ---------------------------------------------------------------------------------------------
# KVCacheManager: prefix hits and sharing

BS = 4


def test_shared_three_block_prefix_is_hit_and_shared() -> None:
    """A second prompt with the same 3-block prefix reuses the same physical blocks."""
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(14)))
    assert admit(manager, a) == 0
    b = make_request("b", [*range(12), 99])
    assert admit(manager, b) == 12
    assert manager.get_block_ids("b")[:3] == manager.get_block_ids("a")[:3]
    assert manager.get_block_ids("b")[3] not in manager.get_block_ids("a")
    shared = manager.block_pool.blocks[manager.get_block_ids("a")[0]]
    assert shared.ref_cnt == 2
    assert manager.prefix_cache_queries == 14 + 13
    assert manager.prefix_cache_hits == 12
    assert manager.num_free_blocks == 16 - 4 - 1


def test_hit_never_covers_the_whole_prompt() -> None:
    """A prompt that is exactly 3 cached blocks only hits 2, so its last token is computed."""
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    admit(manager, make_request("a", list(range(12))))
    assert admit(manager, make_request("b", list(range(12)))) == 8


def test_hit_on_freed_cached_blocks_takes_them_off_the_free_queue() -> None:
    """Blocks of a finished request stay hittable; hitting them removes them from the free pool."""
    manager = KVCacheManager(num_blocks=8, block_size=BS)
    a = make_request("a", list(range(13)))
    admit(manager, a)
    ids = manager.get_block_ids("a")
    manager.free(a)
    manager.free(a)  # idempotent
    assert manager.num_free_blocks == 8
    b = make_request("b", list(range(13)))
    assert admit(manager, b) == 12
    assert manager.get_block_ids("b")[:3] == ids[:3]
    assert manager.num_free_blocks == 8 - 4


def test_blocks_a_failed_step_was_to_write_are_never_hit() -> None:
    """Blocks enter the prefix cache when their step is scheduled; a step that failed or never
    ran leaves them unwritten, so ``uncache_from`` drops them (and only them) from the cache
    and a later request misses from there on."""
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", list(range(13)))
    a.num_computed_tokens = 4  # one block written before the failed step
    assert manager.allocate_slots(a, 9)
    manager.uncache_from(a, 4)
    manager.free(a)
    assert admit(manager, make_request("b", list(range(13)))) == 4
    # Its own later steps offer the blocks again once they are written.
    assert admit(manager, make_request("c", list(range(13)))) == 12


def test_hit_requires_the_whole_prefix_not_just_the_block() -> None:
    """A block with equal tokens after a different earlier block is not a hit (hashes chain)."""
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    admit(manager, make_request("a", [*range(4), *range(10, 14), 0]))
    admit(manager, make_request("b", [*range(20, 24), *range(30, 34), 0]))
    assert admit(manager, make_request("c", [*range(4), *range(30, 34), 0])) == 4


def test_no_hit_with_prefix_caching_off() -> None:
    """With caching off and no share key, identical prompts get distinct blocks."""
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    admit(manager, make_request("a", list(range(13))))
    assert admit(manager, make_request("b", list(range(13)))) == 0
    assert not set(manager.get_block_ids("a")) & set(manager.get_block_ids("b"))
    assert manager.prefix_cache_queries == 0


def test_share_key_shares_blocks_with_caching_off() -> None:
    """Siblings with the same share key share prompt blocks; other keys do not."""
    manager = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=False)
    admit(manager, make_request("a", list(range(13)), prefix_share_key="g"))
    assert admit(manager, make_request("b", list(range(13)), prefix_share_key="g")) == 12
    assert admit(manager, make_request("c", list(range(13)), prefix_share_key="h")) == 0
    assert admit(manager, make_request("d", list(range(13)))) == 0
    assert manager.get_block_ids("a")[:3] == manager.get_block_ids("b")[:3]


@pytest.mark.parametrize(
    ("first", "second"),
    [
        ({"cache_salt": "x"}, {"cache_salt": "y"}),
        ({"cache_salt": "x"}, {}),
        ({"lora_name": "l1"}, {"lora_name": "l2"}),
    ],
)
def test_different_salt_or_adapter_prevents_sharing(first: dict, second: dict) -> None:
    """Different cache salts or LoRA adapters never share blocks, even for equal tokens."""
    manager = KVCacheManager(num_blocks=16, block_size=BS)
    admit(manager, make_request("a", list(range(13)), **first))
    assert admit(manager, make_request("b", list(range(13)), **second)) == 0
    assert admit(manager, make_request("c", list(range(13)), **first)) == 12


def test_extra_keys_fn_result_enters_the_hash() -> None:
    """Hook keys (a list, as a plugin hook returns) decide sharing: equal share, unequal don't."""
    manager = KVCacheManager(
        num_blocks=16, block_size=BS, extra_keys_fn=lambda r: [r.request_id[0], None]
    )
    admit(manager, make_request("a1", list(range(13))))
    assert admit(manager, make_request("b1", list(range(13)))) == 0
    assert admit(manager, make_request("a2", list(range(13)))) == 12


def test_failed_allocation_changes_nothing() -> None:
    """allocate_slots returns False and leaves blocks, ref counts and free queue untouched."""
    manager = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request("a", list(range(9)))
    admit(manager, a)
    manager.free(a)
    b = make_request("b", [*range(8), 50, 51, 52, 53, 54, 55, 56, 57, 58])
    hit, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    queue_before = [blk.block_id for blk in manager.block_pool.free_block_queue]
    # 2 hit blocks are free, plus 3 new blocks needed: 5 > 4 free.
    assert not manager.allocate_slots(b, b.num_tokens - num_hit, hit)
    assert [blk.block_id for blk in manager.block_pool.free_block_queue] == queue_before
    assert all(blk.ref_cnt == 0 for blk in manager.block_pool.blocks)
    assert manager.get_block_ids("b") == []
    assert manager.allocate_slots(b, 4, hit)  # a smaller chunk fits
    assert manager.get_block_ids("b")[:2] == [blk.block_id for blk in hit]


# ---------------------------------------------------------------------------------------------
# KVCacheManager: LRU eviction order


def test_eviction_order_is_lru_and_tail_block_first() -> None:
    """Freed blocks are reused least-recently-freed first, and a request's tail before its head."""
    manager = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", [1, 1, 2, 2, 3, 3])
    b = make_request("b", [7, 7, 8, 8])
    admit(manager, a)
    admit(manager, b)
    a_ids, b_ids = manager.get_block_ids("a"), manager.get_block_ids("b")
    (never_used,) = set(range(6)) - set(a_ids) - set(b_ids)
    manager.free(a)
    manager.free(b)
    queue = [blk.block_id for blk in manager.block_pool.free_block_queue]
    assert queue == [never_used, *reversed(a_ids), *reversed(b_ids)]

    # A new 4-token request takes the untouched block and a's tail block.
    c = make_request("c", [9, 9, 9, 9])
    admit(manager, c)
    assert manager.get_block_ids("c") == [never_used, a_ids[2]]
    # a's head blocks and all of b (freed most recently) are still cached.
    hit_a, _ = manager.get_computed_blocks(make_request("a2", [1, 1, 2, 2, 3, 3, 5]))
    assert [blk.block_id for blk in hit_a] == a_ids[:2]
    hit_b, _ = manager.get_computed_blocks(make_request("b2", [7, 7, 8, 8, 5]))
    assert [blk.block_id for blk in hit_b] == b_ids


# ---------------------------------------------------------------------------------------------
# KVCacheManager: state machine over random requests

SM_BLOCK_SIZE = 2
SM_NUM_BLOCKS = 8
tokens_st = st.integers(0, 1)  # a tiny vocabulary so prompts share prefixes often
# Common prefixes plus a random tail: shared heads with diverging middles, so a hit that
# skipped the parent hash in its chain would find a block written after a different prefix.
prompts_st = st.builds(
    lambda head, tail: head + tail,
    st.sampled_from([[], [0, 0, 1, 1], [0, 0, 1, 1, 0, 1], [1, 0, 0, 1]]),
    st.lists(tokens_st, max_size=4),
).filter(bool)


class KVCacheManagerMachine(RuleBasedStateMachine):
    """Random admit / decode / preempt / finish sequences, with invariants after every step.

    ``written`` is an independent model of the physical cache: for each block id, the identity
    (share group, salt, adapter, hook keys, full token prefix) of the K/V last written into it.
    A prefix hit must return blocks whose written identity matches the hitting request.
    """

    def __init__(self) -> None:
        super().__init__()
        self.manager: KVCacheManager | None = None
        self.extra_keys_fn: Callable[[Request], tuple] | None = None
        self.waiting: dict[str, Request] = {}
        self.running: dict[str, Request] = {}
        self.written: dict[int, tuple] = {}
        self.num_written_blocks: dict[str, int] = {}
        self.next_id = 0

    @initialize(caching=st.booleans(), use_hook=st.booleans())
    def setup(self, caching: bool, use_hook: bool) -> None:
        if use_hook:
            self.extra_keys_fn = lambda r: ("parity", r.num_prompt_tokens % 2)
        self.manager = KVCacheManager(
            SM_NUM_BLOCKS,
            SM_BLOCK_SIZE,
            enable_prefix_caching=caching,
            extra_keys_fn=self.extra_keys_fn,
        )

    # -- model helpers ------------------------------------------------------------------------

    def identity(self, request: Request, block_index: int) -> tuple:
        assert self.manager is not None
        share = None if self.manager.enable_prefix_caching else request.prefix_share_key
        hook = self.extra_keys_fn(request) if self.extra_keys_fn else None
        end = (block_index + 1) * SM_BLOCK_SIZE
        assert request.num_tokens >= end
        return (
            share,
            request.cache_salt,
            request.lora_name,
            hook,
            tuple(request.all_token_ids[:end]),
        )

    def live(self) -> list[Request]:
        return [*self.waiting.values(), *self.running.values()]

    def held_counts(self) -> Counter[int]:
        assert self.manager is not None
        return Counter(i for r in self.live() for i in self.manager.get_block_ids(r.request_id))

    def snapshot(self) -> tuple:
        assert self.manager is not None
        pool = self.manager.block_pool
        return (
            [(b.ref_cnt, b.block_hash) for b in pool.blocks],
            [b.block_id for b in pool.free_block_queue],
            {r.request_id: self.manager.get_block_ids(r.request_id) for r in self.live()},
        )

    def allocate_and_check(
        self, request: Request, num_new: int, hit: list[KVCacheBlock], lookahead: int = 0
    ) -> bool:
        """Allocate; success must be exactly 'the model says enough blocks are free'."""
        assert self.manager is not None
        held = self.held_counts()
        model_free = SM_NUM_BLOCKS - len(held)
        owned = len(self.manager.get_block_ids(request.request_id))
        total = request.num_computed_tokens + len(hit) * SM_BLOCK_SIZE + num_new + lookahead
        needed = max(0, -(-total // SM_BLOCK_SIZE) - owned - len(hit))
        hit_free = sum(1 for b in hit if held[b.block_id] == 0)
        before = self.snapshot()
        ok = self.manager.allocate_slots(request, num_new, hit, lookahead)
        assert ok == (needed + hit_free <= model_free)
        if not ok:
            assert self.snapshot() == before
        return ok

    def record_writes(self, request: Request) -> None:
        """Blocks this request just filled hold its content now, and only it may hold them."""
        assert self.manager is not None
        ids = self.manager.get_block_ids(request.request_id)
        num_full = request.num_computed_tokens // SM_BLOCK_SIZE
        for i in range(self.num_written_blocks[request.request_id], num_full):
            assert self.manager.block_pool.blocks[ids[i]].ref_cnt == 1
            self.written[ids[i]] = self.identity(request, i)
        self.num_written_blocks[request.request_id] = max(
            num_full, self.num_written_blocks[request.request_id]
        )

    @staticmethod
    def pick(requests: dict[str, Request], index: int) -> Request:
        return list(requests.values())[index % len(requests)]

    def schedule(self, request: Request, chunk: int) -> None:
        """Admit a waiting request with up to ``chunk`` new tokens after its prefix hit."""
        assert self.manager is not None
        hit, num_hit = self.manager.get_computed_blocks(request)
        assert num_hit == len(hit) * SM_BLOCK_SIZE
        assert num_hit <= request.num_prompt_tokens - 1
        if not (self.manager.enable_prefix_caching or request.prefix_share_key):
            assert hit == []
        for i, block in enumerate(hit):
            assert self.written.get(block.block_id) == self.identity(request, i)
        num_new = min(chunk, request.num_tokens - num_hit)
        if self.allocate_and_check(request, num_new, hit):
            request.num_computed_tokens = num_hit + num_new
            self.num_written_blocks[request.request_id] = len(hit)
            self.record_writes(request)
            self.running[request.request_id] = self.waiting.pop(request.request_id)

    # -- rules --------------------------------------------------------------------------------

    @precondition(lambda self: self.manager is not None)
    @rule(
        prompt=prompts_st,
        salt=st.sampled_from([None, None, None, "s"]),
        share=st.sampled_from([None, "g1", "g1", "g2"]),
        lora=st.sampled_from([None, None, None, "l"]),
        chunk=st.integers(1, 8),
    )
    def add_and_schedule(
        self,
        prompt: list[int],
        salt: str | None,
        share: str | None,
        lora: str | None,
        chunk: int,
    ) -> None:
        rid = f"r{self.next_id}"
        self.next_id += 1
        request = make_request(rid, prompt, cache_salt=salt, prefix_share_key=share, lora_name=lora)
        self.waiting[rid] = request
        self.schedule(request, chunk)

    @precondition(lambda self: self.waiting)
    @rule(index=st.integers(0, 100), chunk=st.integers(1, 8))
    def schedule_waiting(self, index: int, chunk: int) -> None:
        self.schedule(self.pick(self.waiting, index), chunk)

    @precondition(lambda self: self.running)
    @rule(
        index=st.integers(0, 100),
        chunk=st.integers(1, 8),
        lookahead=st.integers(0, 2),
        sampled=tokens_st,
    )
    def step_running(self, index: int, chunk: int, lookahead: int, sampled: int) -> None:
        request = self.pick(self.running, index)
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(sampled)
        num_new = min(chunk, request.num_tokens - request.num_computed_tokens)
        if self.allocate_and_check(request, num_new, [], lookahead):
            request.num_computed_tokens += num_new
            self.record_writes(request)

    @precondition(lambda self: self.running)
    @rule(index=st.integers(0, 100))
    def preempt(self, index: int) -> None:
        assert self.manager is not None
        request = self.pick(self.running, index)
        self.manager.free(request)
        request.num_computed_tokens = 0
        self.waiting[request.request_id] = self.running.pop(request.request_id)

    @precondition(lambda self: self.waiting or self.running)
    @rule(index=st.integers(0, 100))
    def finish(self, index: int) -> None:
        assert self.manager is not None
        requests = {**self.waiting, **self.running}
        request = self.pick(requests, index)
        self.manager.free(request)
        self.manager.free(request)
        self.waiting.pop(request.request_id, None)
        self.running.pop(request.request_id, None)

    @precondition(lambda self: self.manager is not None)
    @rule()
    def reset_prefix_cache(self) -> None:
        assert self.manager is not None
        assert self.manager.reset_prefix_cache() == (not self.held_counts())

    # -- invariants ---------------------------------------------------------------------------

    @invariant()
    def pool_is_consistent(self) -> None:
        if self.manager is None:
            return
        pool = self.manager.block_pool
        queued = [b.block_id for b in pool.free_block_queue]
        assert len(set(queued)) == len(queued) == len(pool.free_block_queue)
        held = self.held_counts()
        for block in pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == held[block.block_id]
            assert (block.block_id in queued) == (block.ref_cnt == 0)
            if block.block_hash is not None:
                assert pool.get_cached_block(block.block_hash) is block
        assert sum(b.ref_cnt for b in pool.blocks) == sum(held.values())
        assert self.manager.num_free_blocks == SM_NUM_BLOCKS - len(held)
        assert self.manager.usage == pytest.approx(len(held) / SM_NUM_BLOCKS)

    @invariant()
    def shared_blocks_have_identical_contents(self) -> None:
        if self.manager is None:
            return
        holders: dict[int, list[tuple[Request, int]]] = {}
        for request in self.live():
            ids = self.manager.get_block_ids(request.request_id)
            assert len(set(ids)) == len(ids)
            for i, block_id in enumerate(ids):
                holders.setdefault(block_id, []).append((request, i))
        for block_id, users in holders.items():
            if len(users) > 1:
                identities = {self.identity(r, i) for r, i in users}
                assert identities == {self.written[block_id]}

    def teardown(self) -> None:
        if self.manager is None:
            return
        for request in self.live():
            self.manager.free(request)
        assert self.manager.num_free_blocks == SM_NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.manager.block_pool.blocks)


KVCacheManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None
)
test_kv_cache_manager_state_machine = KVCacheManagerMachine.TestCase
