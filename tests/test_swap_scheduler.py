"""The scheduler with swap preemption, on its own (no model): device blocks that swapped-out
requests keep (shared when they were swapped out) never stall the engine."""

from __future__ import annotations

from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.request import Request, RequestStatus
from hitchllm.sampling_params import SamplingParams
from hitchllm.scheduler.policy import PreemptionPolicy
from hitchllm.scheduler.preemption import PreemptionMode, SwapCostModel
from hitchllm.scheduler.scheduler import Scheduler, SchedulerConfig


def step(scheduler: Scheduler, token: int = 7):
    plan = scheduler.schedule()
    requests = [scheduler.requests[rid] for rid in plan.request_ids]
    scheduler.update_from_output(plan, requests, {rid: [token] for rid in plan.request_ids})
    return plan


def test_kept_blocks_of_swapped_requests_never_stall_admission():
    kv = KVCacheManager(4, 2, enable_prefix_caching=True, num_host_blocks=8)
    scheduler = Scheduler(SchedulerConfig(8, 64, 32, PreemptionPolicy.PRIORITY,
                                          PreemptionMode.SWAP), kv)
    params = SamplingParams(max_tokens=16)
    a = Request("a", [1, 2, 3, 4, 5], params, priority=1)
    b = Request("b", [1, 2, 3, 4, 9], params, priority=1)
    scheduler.add_request(a)
    step(scheduler)
    scheduler.add_request(b)
    step(scheduler)  # b hits a's two full prompt blocks: all 4 blocks in use
    assert kv.num_free_blocks == 0
    # Both swapped out: the 2 shared blocks stay on the device, kept by both.
    scheduler._preempt(b)
    scheduler._preempt(a)
    assert kv.is_swapped("a") and kv.is_swapped("b") and kv.num_free_blocks == 2
    # A more urgent request needs all 4 blocks; nothing runs to free the kept ones.
    c = Request("c", list(range(20, 27)), params, priority=0)
    scheduler.add_request(c)
    plan = scheduler.schedule()
    assert plan.request_ids == ["c"]
    assert not kv.is_swapped("a") and not kv.is_swapped("b")  # recomputed instead
    assert a.num_computed_tokens == b.num_computed_tokens == 0
    assert scheduler.stats.num_swap_fallbacks == 2
    scheduler.finish_requests(["a", "b", "c"], RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 4 and kv.num_free_host_blocks == 8


def test_the_auto_rule():
    cost = SwapCostModel(swap_seconds_per_block=1e-3)
    assert cost.prefers_swap(10, 1)  # no throughput seen yet: swap
    cost.observe_step(1000, 1.0)  # 1 ms per token
    assert cost.prefers_swap(10, 11) and not cost.prefers_swap(10, 9)
    cost.observe_step(100, 1.0)  # a slower step: the best rate seen stays
    assert cost.recompute_tokens_per_s == 1000
    # A recompute delays every request sharing its steps; the copies delay only the one.
    assert not cost.prefers_swap(10, 3, requests_sharing_the_steps=3)
    assert cost.prefers_swap(10, 3, requests_sharing_the_steps=4)


def test_swap_mode_needs_a_host_pool():
    import pytest

    with pytest.raises(ValueError, match="needs a host pool"):
        Scheduler(SchedulerConfig(8, 64, 32, preemption_mode=PreemptionMode.SWAP),
                  KVCacheManager(4, 2))
