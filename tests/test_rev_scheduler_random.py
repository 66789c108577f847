"""Review: the scheduler under random workloads mixing the three features (micro-batches in
flight, swap / auto / recompute preemption, a KV-transfer consumer with loads that arrive late
or fail) with prefix sharing, priorities, chunked prompts and aborts. Each run must finish with
no step that the engine would call "no progress", and with both block pools whole. (This found
the stalls fixed in this branch: kept blocks of swapped-out siblings, and loaded consumer
requests behind a preempted one.)"""

from __future__ import annotations

import random
from collections import deque

import pytest

from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.kv_transfer.config import KVTransferConfig
from hitchllm.kv_transfer.connector import KVTransferEvents
from hitchllm.kv_transfer.scheduling import KVTransferScheduling
from hitchllm.request import Request, RequestStatus
from hitchllm.sampling_params import SamplingParams
from hitchllm.scheduler.policy import PreemptionPolicy
from hitchllm.scheduler.preemption import PreemptionMode
from hitchllm.scheduler.scheduler import Scheduler, SchedulerConfig

BLOCK_SIZE = 2


def simulate(seed: int, consumer: bool) -> None:
    rnd = random.Random(seed)
    num_blocks = rnd.randint(4, 10)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, enable_prefix_caching=rnd.random() < 0.5,
                        num_host_blocks=rnd.randint(2, 20))
    clock = [0.0]
    transfers = KVTransferScheduling(KVTransferConfig(
        kv_connector="shared_memory", kv_role="consumer", kv_load_timeout_s=8),
        kv, clock=lambda: clock[0]) if consumer else None
    micro_batches = 1 if consumer else rnd.choice([1, 2, 3])  # no KV transfer with stages
    scheduler = Scheduler(SchedulerConfig(
        rnd.randint(2, 8), rnd.choice([3, 8, 64]), 64, rnd.choice(list(PreemptionPolicy)),
        rnd.choice(list(PreemptionMode)), num_micro_batches=micro_batches), kv,
        kv_transfer=transfers)
    arriving = []
    for i in range(rnd.randint(2, 6)):
        prompt_len = rnd.randint(1, 6)
        prompt = ([1, 2, 3, 4, 5, 6][:prompt_len] if rnd.random() < 0.6
                  else [rnd.randint(10, 20) for _ in range(prompt_len)])
        # Each request alone fits the cache (the engine refuses one that does not).
        max_tokens = max(1, min(rnd.randint(1, 12), num_blocks * BLOCK_SIZE - prompt_len + 1))
        request = Request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                          priority=rnd.randint(0, 2))
        if rnd.random() < 0.3:
            request.prefix_share_key = "siblings"
        if consumer and rnd.random() < 0.7:
            request.kv_transfer_params = {"remote_request_id": f"p{i}"}
        arriving.append(request)
    in_flight: deque = deque()
    loading: dict[str, float] = {}
    for _ in range(400):
        clock[0] += 1
        if arriving and rnd.random() < 0.5:
            scheduler.add_request(arriving.pop(0))
        if rnd.random() < 0.05 and scheduler.requests:
            scheduler.finish_requests([rnd.choice(list(scheduler.requests))],
                                      RequestStatus.FINISHED_ABORTED)
        busy = {r for _, requests in in_flight for r in requests}
        plan = scheduler.schedule(busy)
        hosts = [h for _, h in plan.swap_out]
        assert len(hosts) == len(set(hosts)), "a host block written twice by one plan"
        computing = any(not p.is_empty for p, _ in in_flight)
        assert not (plan.is_empty and not computing and scheduler.has_unfinished_requests()
                    and not (transfers is not None and transfers.has_work())), "no progress"
        in_flight.append((plan, [scheduler.requests[rid] for rid in plan.request_ids]))
        for load in plan.kv_loads:
            loading[load.request_id] = clock[0] + rnd.randint(0, 12)  # some time out
        for rid in (*plan.finished_ids, *plan.kv_load_cancels):
            loading.pop(rid, None)
        events = KVTransferEvents()
        for rid, due in list(loading.items()):
            if due <= clock[0]:
                del loading[rid]
                if rnd.random() < 0.1:
                    events.loads_failed.append((rid, "a broken transfer"))
                else:
                    events.loads_ready.append(rid)
        scheduler.update_kv_transfers(events)
        # Complete the oldest steps while M are in flight, or when nothing was free to launch.
        while in_flight and (in_flight[0][0].is_empty or plan.is_empty or sum(
                not p.is_empty for p, _ in in_flight) >= micro_batches):
            done, requests = in_flight.popleft()
            scheduler.update_from_output(done, requests, {r: [7] for r in done.request_ids})
            if plan.is_empty and not done.is_empty:
                break
        if not arriving and not in_flight and not scheduler.has_unfinished_requests():
            break
    else:
        pytest.fail("the requests did not finish")
    assert kv.num_free_blocks == kv.num_blocks
    assert kv.num_free_host_blocks == kv.num_host_blocks


@pytest.mark.parametrize("consumer", [False, True])
def test_random_workloads_finish_without_stalls_or_leaks(consumer):
    for seed in range(300):
        simulate(seed, consumer)
