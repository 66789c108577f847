"""Which replica serves a request: the least loaded one, unless a replica that recently
served the same prompt prefix (and so likely still holds its KV blocks in its prefix cache)
is not much busier.

Load is what the server has routed to a replica and not yet seen finish: its running plus
waiting requests. Ties go round robin. Prefixes are remembered as chained hashes of the
prompt's full KV-cache blocks, so the deepest block a new prompt shares with an earlier one
names the replica to prefer.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hitchllm.config import EngineConfig


class NoLiveReplicaError(RuntimeError):
    """Every replica has stopped."""


@dataclass(frozen=True)
class BalancerPolicy:
    """How far prefix affinity may override load."""

    # Tokens per KV-cache block: the unit the replicas' prefix caches share.
    block_size: int = 16
    # A prefix must cover at least this many full blocks to attract a request: shorter ones
    # (a chat template's header, which every conversation shares) save less prefill than
    # an uneven spread costs.
    min_affinity_blocks: int = 4
    # The prefix's replica is taken while its load is at most the least load plus
    # max(affinity_slack, least load // 2); else the least loaded wins.
    affinity_slack: int = 4
    # Blocks of a prompt remembered, and remembered blocks in all (least recent dropped).
    max_prefix_blocks: int = 64
    max_remembered_blocks: int = 1 << 17

    @classmethod
    def for_config(cls, config: EngineConfig) -> BalancerPolicy:
        """The policy for replicas run with ``config``: its block size, and no prefix
        affinity when its prefix cache is off (a shared prefix saves nothing there)."""
        if config.enable_prefix_caching:
            return cls(block_size=config.block_size)
        return cls(block_size=config.block_size, max_prefix_blocks=0)


def prefix_keys(token_ids: Sequence[int], salt: object, block_size: int,
                max_blocks: int) -> list[int]:
    """Chained hashes of the prompt's full blocks (the first ``max_blocks``): key ``k``
    stands for the first ``k + 1`` blocks. ``salt`` (the LoRA adapter, a cache salt)
    separates prompts that cannot share cached blocks."""
    keys = []
    key = hash(salt)
    for start in range(0, min(len(token_ids) // block_size, max_blocks) * block_size,
                       block_size):
        key = hash((key, tuple(token_ids[start:start + block_size])))
        keys.append(key)
    return keys


class LoadBalancer:
    """Chooses replicas and counts their load; safe to call from several threads."""

    def __init__(self, num_replicas: int, policy: BalancerPolicy | None = None) -> None:
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be at least 1, got {num_replicas}")
        self.policy = policy or BalancerPolicy()
        self.load = [0] * num_replicas
        self.routed = [0] * num_replicas
        self.alive = [True] * num_replicas
        self._next = 0
        self._prefixes: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    def choose(self, token_ids: Sequence[int] | None = None, salt: object = None) -> int:
        """The replica for a new request (its load is counted from now until ``finished``);
        ``NoLiveReplicaError`` when none is alive."""
        p = self.policy
        keys = [] if token_ids is None else prefix_keys(token_ids, salt, p.block_size,
                                                        p.max_prefix_blocks)
        with self._lock:
            live = [i for i, up in enumerate(self.alive) if up]
            if not live:
                raise NoLiveReplicaError("no data-parallel replica is running")
            least = min(self.load[i] for i in live)
            choice = self._affine(keys, least)
            if choice is None:
                tied = [i for i in live if self.load[i] == least]
                choice = next((i for i in tied if i >= self._next), tied[0])
                self._next = (choice + 1) % len(self.load)
            for key in keys:
                self._prefixes[key] = choice
                self._prefixes.move_to_end(key)
            while len(self._prefixes) > p.max_remembered_blocks:
                self._prefixes.popitem(last=False)
            self.load[choice] += 1
            self.routed[choice] += 1
            return choice

    def _affine(self, keys: list[int], least: int) -> int | None:
        """The replica that served the deepest remembered prefix, if it is deep enough and
        that replica is not much busier than ``least``."""
        for depth in range(len(keys), max(1, self.policy.min_affinity_blocks) - 1, -1):
            replica = self._prefixes.get(keys[depth - 1])
            if replica is not None and self.alive[replica]:
                slack = max(self.policy.affinity_slack, least // 2)
                return replica if self.load[replica] <= least + slack else None
        return None

    def finished(self, replica: int) -> None:
        """A request routed to ``replica`` ended (finished, failed or aborted)."""
        with self._lock:
            self.load[replica] -= 1

    def mark_dead(self, replica: int) -> None:
        """Route nothing more to ``replica``."""
        with self._lock:
            self.alive[replica] = False
            for key in [k for k, r in self._prefixes.items() if r == replica]:
                del self._prefixes[key]
