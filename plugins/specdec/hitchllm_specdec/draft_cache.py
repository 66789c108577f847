"""The draft model's own paged KV cache: which blocks each request holds and how many of its
tokens they hold, with rollback of rejected drafts.

The draft model caches K/V in blocks of the engine's ``block_size`` from its own
``BlockPool`` (the core's), separate from the target's pool. Per request it keeps what it
computed: the context it drafted from (``num_context`` tokens) and, after that context, the
drafts it fed back to make the next ones. When the request comes back after a step, its new
tokens are compared with those drafts: the cache stays valid up to the first draft the target
did not accept, and everything after it is recomputed (``catch_up``). Sequences only grow, so
this comparison is all the bookkeeping a rollback needs.

Blocks are freed when the engine says a request finished (``free``); when the pool runs short,
the blocks of requests not being drafted for right now (preempted, or waiting a step) are
evicted first, least recently used first (their state, and its seeded generator, stays until
the request finishes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from hitchllm.kv_cache.block_pool import BlockPool, KVCacheBlock


@dataclass(eq=False)
class DraftState:
    """What the draft cache holds for one request."""

    request_id: str
    blocks: list[KVCacheBlock] = field(default_factory=list)
    # Tokens of the request whose K/V is cached (a prefix of its sequence, then fed drafts).
    num_computed: int = 0
    # The request's length when it was last drafted for, and the drafts made then.
    num_context: int = 0
    drafts: list[int] = field(default_factory=list)
    # The request's own generator for its draft noise (seeded requests only).
    generator: torch.Generator | None = None
    last_used: int = 0

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass
class DraftStats:
    """Drafts verified by the target and how many of them it accepted (counted when a
    request comes back, so the drafts of a request's last step are not counted)."""

    num_drafts: int = 0
    num_accepted: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafts if self.num_drafts else 0.0


class DraftKVCache:
    """Block accounting of the draft model's KV cache (the tensors live in the runner)."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.states: dict[str, DraftState] = {}
        self.stats = DraftStats()
        self._clock = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def catch_up(self, request_id: str, token_ids: Sequence[int]) -> DraftState:
        """The request's state with ``num_computed`` rolled back to what is still valid for
        ``token_ids`` (a new request starts empty), short of the newest token."""
        self._clock += 1
        state = self.states.get(request_id)
        if state is None or len(token_ids) < state.num_context:
            if state is not None:  # not this request's sequence any more: start over
                self.free(request_id)
            state = self.states[request_id] = DraftState(request_id)
        elif state.drafts:
            new = token_ids[state.num_context :]
            accepted = 0
            for draft, token in zip(state.drafts, new):
                if draft != token:
                    break
                accepted += 1
            self.stats.num_drafts += len(state.drafts)
            self.stats.num_accepted += accepted
            # Drafts fed back (all but the last, or all) keep their K/V where accepted.
            state.num_computed = min(state.num_computed, state.num_context + accepted)
            state.drafts = []
        # The newest token is always computed again: its logits give draft 1. (Its K/V may be
        # cached already: a draft the step did not verify, dropped by the scheduler or lost
        # to preemption, can equal the token the target sampled instead.)
        state.num_computed = min(state.num_computed, len(token_ids) - 1)
        state.last_used = self._clock
        return state

    def allocate(self, state: DraftState, num_tokens: int, busy: set[str]) -> bool:
        """Make ``state`` hold blocks for ``num_tokens`` tokens, evicting states not in
        ``busy`` (least recently used first) if the pool runs short. False, changing nothing
        of ``state``, when even that is not enough."""
        needed = -(-num_tokens // self.block_size) - len(state.blocks)
        if needed <= 0:
            return True
        if needed > self.num_free_blocks:
            idle = sorted((s for s in self.states.values()
                           if s.request_id not in busy and s.blocks),
                          key=lambda s: s.last_used)
            for victim in idle:
                if needed <= self.num_free_blocks:
                    break
                self.evict(victim)
            if needed > self.num_free_blocks:
                return False
        state.blocks += self.block_pool.get_new_blocks(needed)
        return True

    def evict(self, state: DraftState) -> None:
        """Give a request's blocks back (idle, or not drafted for this step); it is recomputed
        when drafted for again. Its generator stays: a seeded request must go on with fresh
        noise, not draw its earlier drafts' noise again (its context depends on those
        drafts)."""
        self.block_pool.free_blocks(reversed(state.blocks))
        state.blocks = []
        state.num_computed = state.num_context = 0
        state.drafts = []

    def free(self, request_id: str) -> None:
        """Give the request's blocks back and forget it (unknown ids are ignored)."""
        state = self.states.pop(request_id, None)
        if state is not None:
            self.block_pool.free_blocks(reversed(state.blocks))
            state.blocks = []
