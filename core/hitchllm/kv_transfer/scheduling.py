"""The scheduler's side of KV transfer: which requests save or load, their reserved blocks,
and the fallback when a load never comes.

Producer: a finished request that asked for remote decode (and computed its prompt) keeps its
blocks until the next plan carries its ``KVSave``; the blocks are freed right after that plan
is built, so the runner copies them out before any later step can reuse them.

Consumer: a waiting request that arrives with the producer's transfer params gets blocks for
its prompt, receives the KV of all of it but the last token (whose logits the consumer computes
itself, to sample the first token) and waits in ``WAITING_FOR_REMOTE_KV`` outside the queues
while the connector receives. When the runner reports it here, the request goes back to the
front of the waiting queue with those tokens computed, and the next plan has the runner copy
the KV into its blocks before the forward that computes the last prompt token. A load that
fails, or is not here within ``kv_load_timeout_s``, is cancelled and the request computes its
prompt itself (logged).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.kv_transfer.config import KVTransferConfig
from hitchllm.kv_transfer.connector import KVLoad, KVSave, KVTransferEvents
from hitchllm.request import Request, RequestStatus
from hitchllm.scheduler.step_plan import StepPlan

logger = logging.getLogger(__name__)


def num_transfer_tokens(request: Request) -> int:
    """Tokens whose KV moves: the prompt but its last token."""
    return request.num_prompt_tokens - 1


class KVTransferScheduling:
    """Per-engine bookkeeping of saves (producer) and loads (consumer)."""

    def __init__(self, config: KVTransferConfig, kv_cache: KVCacheManager,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.clock = clock
        # Consumer: requests whose KV is on its way, and when each stops waiting.
        self.receiving: dict[str, Request] = {}
        self._deadlines: dict[str, float] = {}
        # Consumer: requests whose KV arrived, holding their blocks, until they run or end.
        self._loaded: set[str] = set()
        # Producer: finished requests whose blocks wait for their save to be planned, and
        # the saves planned but not reported done yet (with when the engine stops waiting).
        self._saves: list[Request] = []
        self._saving: dict[str, float] = {}
        # What the next plan tells the runner.
        self._loads: list[KVLoad] = []
        self._finishes: list[str] = []
        self._cancels: list[str] = []
        self.num_fallbacks = 0

    @property
    def is_producer(self) -> bool:
        return self.config.kv_role == "producer"

    def has_work(self) -> bool:
        """True while a transfer is under way or planned (the engine keeps stepping)."""
        return bool(self.receiving or self._saves or self._saving or self._loads
                    or self._finishes or self._cancels)

    # ---- consumer ------------------------------------------------------------------------

    def wants_load(self, request: Request) -> bool:
        """True for a waiting consumer request that carries transfer params and has computed
        nothing yet (a fallen-back request has none any more). A request that wants prompt
        logprobs computes its prompt: they come from the prompt's logits, which no KV holds."""
        return (not self.is_producer and request.kv_transfer_params is not None
                and request.num_computed_tokens == 0 and num_transfer_tokens(request) > 0
                and request.sampling_params.prompt_logprobs is None)

    def reserve(self, request: Request) -> bool:
        """Reserve blocks for ``request``'s incoming KV and plan the load; False (nothing
        changed) when too few blocks are free. The blocks cover the whole prompt, its last
        token's slot included: a request whose KV arrived then computes that token in blocks
        it holds, so reservations that fill the cache can never keep every one of them from
        running (waiting requests cannot be preempted to make room)."""
        num_tokens = num_transfer_tokens(request)
        if not self.kv_cache.reserve_blocks(request, request.num_prompt_tokens):
            return False
        rid = request.request_id
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.receiving[rid] = request
        self._deadlines[rid] = self.clock() + self.config.kv_load_timeout_s
        assert request.kv_transfer_params is not None
        num_blocks = -(-num_tokens // self.kv_cache.block_size)  # those the KV fills
        self._loads.append(KVLoad(rid, list(self.kv_cache.get_block_ids(rid)[:num_blocks]),
                                  num_tokens, dict(request.kv_transfer_params)))
        return True

    def update(self, events: KVTransferEvents) -> list[Request]:
        """Fold the runner's news in; returns the requests to put back in the waiting queue
        (front): those whose KV arrived, and those that fall back to computing."""
        for rid in events.saves_done:
            self._saving.pop(rid, None)
        back = []
        for rid in events.loads_ready:
            request = self.receiving.pop(rid, None)
            if request is None:
                continue  # cancelled meanwhile (aborted, timed out)
            del self._deadlines[rid]
            request.num_computed_tokens = num_transfer_tokens(request)
            request.status = RequestStatus.WAITING
            request.kv_transfer_params = None  # preempted later, it computes like any other
            self._finishes.append(rid)
            self._loaded.add(rid)
            back.append(request)
        for rid, why in events.loads_failed:
            request = self.receiving.get(rid)
            if request is not None:
                back.append(self._fall_back(request, f"the transfer failed: {why}"))
        return back

    def expire(self) -> list[Request]:
        """Requests whose KV did not come in time fall back to computing their prompt;
        returns them (to put back in the waiting queue, front)."""
        now = self.clock()
        for rid in [rid for rid, t in self._saving.items() if t <= now]:
            logger.warning("request %s: its KV save was not reported done within "
                           "kv_load_timeout_s; no longer waiting for it", rid)
            del self._saving[rid]
        late = [self.receiving[rid] for rid, t in self._deadlines.items() if t <= now]
        return [self._fall_back(r, f"no KV within kv_load_timeout_s="
                                   f"{self.config.kv_load_timeout_s:g}") for r in late]

    def _fall_back(self, request: Request, why: str) -> Request:
        rid = request.request_id
        logger.warning("request %s: %s; computing its prompt here instead", rid, why)
        del self.receiving[rid]
        del self._deadlines[rid]
        self._cancels.append(rid)
        self.kv_cache.free(request)
        request.kv_transfer_params = None
        request.status = RequestStatus.WAITING
        self.num_fallbacks += 1
        return request

    def is_loaded(self, request: Request) -> bool:
        """True for a waiting request whose KV arrived: its first ``num_computed_tokens``
        tokens need no computing."""
        return request.request_id in self._loaded

    def forget(self, request: Request) -> None:
        """``request`` ends or is preempted: a load under way or not yet copied in is dropped
        (the scheduler frees its blocks; the runner learns of it from the plan's finished or
        preempted ids)."""
        rid = request.request_id
        self.receiving.pop(rid, None)
        self._deadlines.pop(rid, None)
        self._loaded.discard(rid)
        if rid in self._finishes:
            self._finishes.remove(rid)

    # ---- producer ------------------------------------------------------------------------

    def hold_for_save(self, request: Request) -> bool:
        """A producer request finishes: True (the caller must not free its blocks) when its
        KV is to be saved: it asked for remote decode, ended normally, and computed the tokens
        that move."""
        if (not self.is_producer or request.kv_transfer_out is None
                or request.status not in (RequestStatus.FINISHED_STOPPED,
                                          RequestStatus.FINISHED_LENGTH)
                or request.num_computed_tokens < num_transfer_tokens(request)
                or num_transfer_tokens(request) <= 0):
            return False
        self._saves.append(request)
        return True

    # ---- the plan ------------------------------------------------------------------------

    def requeue(self, plan: StepPlan) -> None:
        """``plan`` never reached the runner (the step before it failed while it waited): its
        loads, finishes and cancels go out with the next plan, ahead of those planned since,
        so no request runs as loaded without its KV copied in and no load waits for its
        timeout. A request preempted meanwhile drops its finish (``forget``; one the dropped
        plan scheduled is preempted by ``quarantine`` and computes its prompt, its arrived KV
        unused), and a load is sent only while its request still waits for it
        (``fill_plan``). Its saves cannot go again (their blocks were freed when it was
        filled): their consumers compute the prompts themselves once ``kv_load_timeout_s``
        passes."""
        self._loads[:0] = plan.kv_loads
        self._finishes[:0] = plan.kv_load_finishes
        self._cancels[:0] = plan.kv_load_cancels
        for save in plan.kv_saves:
            logger.warning("request %s: its KV save was dropped with a failed step; its "
                           "consumer will compute the prompt", save.request_id)
            self._saving.pop(save.request_id, None)

    def fill_plan(self, plan: StepPlan) -> None:
        """Move the planned transfers into ``plan`` and free the blocks of
        the requests saved by it (the runner copies them out before any later step runs)."""
        block_size = self.kv_cache.block_size
        saves = []
        for request in self._saves:
            num_tokens = num_transfer_tokens(request)
            num_blocks = -(-num_tokens // block_size)
            block_ids = self.kv_cache.get_block_ids(request.request_id)[:num_blocks]
            saves.append(KVSave(request.request_id, list(block_ids), num_tokens))
            self.kv_cache.free(request)
            self._saving[request.request_id] = self.clock() + self.config.kv_load_timeout_s
        plan.kv_saves, self._saves = saves, []
        plan.kv_loads = [load for load in self._loads if load.request_id in self.receiving]
        self._loads = []
        plan.kv_load_finishes, self._finishes = self._finishes, []
        plan.kv_load_cancels, self._cancels = self._cancels, []
