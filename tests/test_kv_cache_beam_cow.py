"""Property tests of forking and copy-on-write in the KV cache manager.

A state machine forks, writes (decodes), prunes, preempts, resumes and finishes requests at
random against a small block pool, with the prefix cache on or off. Beside the manager it
keeps a model of the device cache (which token each slot of each block holds) to which it
applies the manager's block copies before each write, as the model runner does. After every
step:

- no reference count is negative; each block's count equals the number of requests holding
  it; a block is in the free queue exactly when no request holds it;
- a request only ever writes into blocks it holds alone (copy-on-write worked);
- every request's computed tokens are what its blocks hold (no sibling overwrote them);

and at the end, once every request is gone, every block is free.
"""

from __future__ import annotations

import itertools
from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hitchllm.kv_cache import KVCacheManager
from hitchllm.request import Request
from hitchllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 24
# A few prompts, some sharing prefixes, so the prefix cache gets hits.
PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 5, 6, 7, 8, 10, 11], [5, 6, 7],
           [20, 21, 22, 23, 24]]


class ForkingCache(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.running: list[Request] = []
        self.preempted: list[Request] = []
        self.ids = itertools.count()
        # The device cache's model: block id -> the token id in each slot (None: never set).
        self.device: dict[int, list[int | None]] = {}

    @initialize(caching=st.booleans())
    def make_manager(self, caching: bool) -> None:
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=caching)
        self.device = {b: [None] * BLOCK_SIZE for b in range(NUM_BLOCKS)}

    def _request(self, prompt: list[int], outputs: list[int] = ()) -> Request:
        request = Request(f"r{next(self.ids)}", prompt, SamplingParams(max_tokens=None))
        for token in outputs:
            request.append_output_token(token)
        return request

    def _compute(self, request: Request, num_new: int, hit: list | None = None) -> bool:
        """Allocate, apply the copies, write the new tokens' slots, as a scheduled step."""
        num_hit = len(hit or []) * BLOCK_SIZE
        if not self.kv.allocate_slots(request, num_new, hit):
            assert self.kv.take_block_copies() == []  # a failed allocation changes nothing
            return False
        for src, dst in self.kv.take_block_copies():
            self.device[dst] = list(self.device[src])
        request.num_computed_tokens += num_hit
        self._write(request, num_new)
        return True

    def _write(self, request: Request, num_new: int) -> None:
        """The forward's writes of the request's next ``num_new`` tokens."""
        blocks = self.kv.block_pool.blocks
        ids = self.kv.get_block_ids(request.request_id)
        for pos in range(request.num_computed_tokens, request.num_computed_tokens + num_new):
            block = ids[pos // BLOCK_SIZE]
            assert blocks[block].ref_cnt == 1, "a write into a block another request holds"
            self.device[block][pos % BLOCK_SIZE] = request.all_token_ids[pos]
        request.num_computed_tokens += num_new

    def _admit(self, request: Request) -> bool:
        hit, _ = self.kv.get_computed_blocks(request)
        num_new = request.num_tokens - len(hit) * BLOCK_SIZE
        return self._compute(request, num_new, hit)

    @rule(prompt=st.sampled_from(PROMPTS))
    def add(self, prompt: list[int]) -> None:
        request = self._request(prompt)
        if self._admit(request):
            self.running.append(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(30, 33))
    def fork(self, data, token: int) -> None:
        """A beam's continuation: the parent's tokens plus one, sharing its blocks."""
        parent = data.draw(st.sampled_from(self.running))
        if parent.num_computed_tokens < parent.num_tokens:
            return
        child = self._request(parent.prompt_token_ids, [*parent.output_token_ids, token])
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.running.append(child)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(30, 33))
    def write(self, data, token: int) -> None:
        """Compute a request's pending token (decode), first giving it one if it has none."""
        request = data.draw(st.sampled_from(self.running))
        if request.num_computed_tokens == request.num_tokens:
            request.append_output_token(token)
        self._compute(request, request.num_tokens - request.num_computed_tokens)

    @precondition(lambda self: len(self.running) > 1)
    @rule(data=st.data(), token=st.integers(30, 33))
    def step(self, data, token: int) -> None:
        """A scheduler step: several requests allocate (copy-on-write among them); when one
        does not fit, a request not in the batch is preempted (its blocks may then be reused
        by the batch in the same step); the copies of the whole step are applied together,
        every source gathered first, as the runner does; then the batch writes."""
        batch = data.draw(st.lists(st.sampled_from(self.running), min_size=1, unique=True))
        scheduled = []
        for request in batch:
            if request not in self.running:
                continue  # preempted earlier in this step
            if request.num_computed_tokens == request.num_tokens:
                request.append_output_token(token)
            num_new = request.num_tokens - request.num_computed_tokens
            while not self.kv.allocate_slots(request, num_new):
                done = [r for r, _ in scheduled]
                others = [r for r in self.running if r is not request and r not in done]
                if not others:
                    break
                self._preempt(data.draw(st.sampled_from(others)))
            else:
                scheduled.append((request, num_new))
        copies = self.kv.take_block_copies()
        sources = {src: list(self.device[src]) for src, _ in copies}
        for src, dst in copies:
            self.device[dst] = list(sources[src])
        for request, num_new in scheduled:
            self._write(request, num_new)

    @precondition(lambda self: self.running or self.preempted)
    @rule(data=st.data())
    def finish(self, data) -> None:
        """A finished or pruned beam: its blocks go back at once."""
        request = data.draw(st.sampled_from(self.running + self.preempted))
        (self.running if request in self.running else self.preempted).remove(request)
        self.kv.free(request)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data) -> None:
        self._preempt(data.draw(st.sampled_from(self.running)))

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.num_computed_tokens = 0
        self.preempted.append(request)

    @precondition(lambda self: self.preempted)
    @rule(data=st.data())
    def resume(self, data) -> None:
        request = data.draw(st.sampled_from(self.preempted))
        if self._admit(request):
            self.preempted.remove(request)
            self.running.append(request)

    @invariant()
    def counts_match_holders(self) -> None:
        if not hasattr(self, "kv"):
            return
        holders = Counter(b for r in self.running for b in self.kv.get_block_ids(r.request_id))
        assert all(not self.kv.get_block_ids(r.request_id) for r in self.preempted)
        queue = set(id(b) for b in self.kv.block_pool.free_block_queue)
        for block in self.kv.block_pool.blocks:
            assert block.ref_cnt >= 0
            assert block.ref_cnt == holders[block.block_id]
            assert (id(block) in queue) == (block.ref_cnt == 0)
        assert self.kv.num_free_blocks + len(holders) == NUM_BLOCKS

    @invariant()
    def computed_tokens_are_in_the_blocks(self) -> None:
        for request in self.running:
            ids = self.kv.get_block_ids(request.request_id)
            for pos in range(request.num_computed_tokens):
                held = self.device[ids[pos // BLOCK_SIZE]][pos % BLOCK_SIZE]
                assert held == request.all_token_ids[pos], (request.request_id, pos)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request in self.running + self.preempted:
            self.kv.free(request)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)


ForkingCache.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestForkingCache = ForkingCache.TestCase


def test_fork_shares_blocks_and_first_write_copies_the_partial_block():
    kv = KVCacheManager(8, BLOCK_SIZE, enable_prefix_caching=False)
    parent = Request("p", [1, 2, 3, 4, 5, 6], SamplingParams())
    assert kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    children = []
    for i, token in enumerate((7, 8)):
        child = Request(f"c{i}", parent.prompt_token_ids, SamplingParams())
        child.append_output_token(token)
        kv.fork(parent, child)
        child.num_computed_tokens = 6
        children.append(child)
    full, partial = kv.get_block_ids("p")
    assert [kv.block_pool.blocks[b].ref_cnt for b in (full, partial)] == [3, 3]
    kv.free(parent)  # the parent is pruned once forked
    assert kv.allocate_slots(children[0], 1)
    [(src, dst)] = kv.take_block_copies()
    assert src == partial and kv.get_block_ids("c0") == [full, dst]
    # The other child now holds the partial block alone and writes it in place.
    assert kv.allocate_slots(children[1], 1)
    assert kv.take_block_copies() == []
    assert kv.get_block_ids("c1") == [full, partial]
    assert kv.block_pool.blocks[full].ref_cnt == 2
