"""A plan that never reaches the runner (the step in flight failed while it waited, see
``LLMEngine._recover``) hands its KV transfers to the next plan: a consumer request never runs
as loaded unless a plan the runner saw copied its KV in, and a load is never lost to its
timeout. The scheduler is driven by hand, the runner simulated: loads become ready only once
a sent plan started them, and arrived KV counts as copied only once a sent plan finished it."""

from __future__ import annotations

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


class Clock:
    """A monotonic clock the test moves by hand (load timeouts)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def consumer(clock: Clock) -> tuple[Scheduler, KVTransferScheduling, KVCacheManager]:
    kv = KVCacheManager(16, 2, enable_prefix_caching=False)
    transfers = KVTransferScheduling(
        KVTransferConfig(kv_connector="shared_memory", kv_role="consumer",
                         kv_load_timeout_s=5), kv, clock=clock)
    # One request runs at a time: a loaded request waits while the other decodes, so the
    # finish of its load goes out with plans that do not schedule it.
    scheduler = Scheduler(SchedulerConfig(1, 64, 64, PreemptionPolicy.FCFS,
                                          PreemptionMode.RECOMPUTE), kv, kv_transfer=transfers)
    return scheduler, transfers, kv


def carries(plan, drop: str) -> bool:
    """Whether ``plan`` carries what the case drops."""
    if drop.startswith("load"):
        return bool(plan.kv_loads)
    if drop.startswith("finish"):
        return any(rid not in plan.request_ids for rid in plan.kv_load_finishes)
    return bool(plan.kv_load_cancels)


@pytest.mark.parametrize("drop", ["load", "finish", "cancel", "load, then abort",
                                  "finish, then abort"])
def test_transfers_of_a_dropped_plan_go_out_with_the_next(drop):
    clock = Clock()
    scheduler, transfers, kv = consumer(clock)
    running = Request("running", [10, 11], SamplingParams(max_tokens=6, ignore_eos=True))
    loaded = Request("loaded", [20, 21, 22, 23, 24], SamplingParams(max_tokens=2,
                                                                     ignore_eos=True))
    loaded.kv_transfer_params = {"remote_request_id": "p"}
    # The loaded request reserves its blocks first; the other one runs in the same step.
    scheduler.add_request(loaded)
    scheduler.add_request(running)
    started, copied, cancelled, dropped = set(), set(), set(), []
    for _ in range(40):
        plan = scheduler.schedule()
        requests = [scheduler.requests[rid] for rid in plan.request_ids]
        if not dropped and carries(plan, drop):
            # The step before this plan failed while it waited: the engine's _recover.
            dropped.append(plan)
            scheduler.uncache_unwritten(plan)
            scheduler.requeue_unsent(plan)
            scheduler.quarantine([], requests)
            if drop.endswith("abort"):
                scheduler.finish_requests(["loaded"], RequestStatus.FINISHED_ABORTED)
            continue
        # The runner: plans it sees start loads, copy arrived KV in and cancel loads.
        assert not started & {load.request_id for load in plan.kv_loads}, "load sent twice"
        started |= {load.request_id for load in plan.kv_loads}
        copied |= set(plan.kv_load_finishes)
        cancelled |= set(plan.kv_load_cancels)
        if "loaded" in plan.request_ids and loaded.num_computed_tokens:
            assert "loaded" in copied or "loaded" in cancelled, (
                "a request ran as loaded without its KV copied in")
        if drop == "cancel":  # this KV never comes: the load times out
            clock.now += 10
            ready = []
        else:
            ready = [rid for rid in started if rid in transfers.receiving]
        scheduler.update_kv_transfers(KVTransferEvents(loads_ready=ready))
        scheduler.update_from_output(plan, requests, {rid: [7] for rid in plan.request_ids})
        if not scheduler.has_unfinished_requests():
            break
    assert dropped, f"no plan carried a {drop} to drop"
    assert running.num_output_tokens == 6
    if drop.endswith("abort"):
        assert loaded.status == RequestStatus.FINISHED_ABORTED
        # Requeued, then left with the aborted request: nothing starts or copies for it.
        assert "loaded" not in copied
        assert drop != "load, then abort" or "loaded" not in started
    elif drop == "cancel":
        assert loaded.num_output_tokens == 2 and transfers.num_fallbacks == 1
        assert cancelled == started == {"loaded"} and not copied
    else:
        assert loaded.num_output_tokens == 2 and loaded.num_computed_tokens >= 4
        assert transfers.num_fallbacks == 0 and started == copied == {"loaded"}
    assert not transfers.has_work()
    assert kv.num_free_blocks == kv.num_blocks
