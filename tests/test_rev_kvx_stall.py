"""Review: a consumer's requests whose KV arrived hold their blocks while they wait to run.
When the one running request then needed one of those blocks, it preempted itself (waiting
requests are never preempted), the step came out empty ("scheduler made no progress" without
async scheduling), and the next steps kept trying the preempted request first, which could not
fit while the loaded requests behind it held their blocks: a stall for good. Loaded requests
now go first (they need no block to run), also in a step whose every running request gave way."""

from __future__ import annotations

import pytest

from hitchllm.kv_cache.manager import KVCacheManager
from hitchllm.kv_transfer.config import KVTransferConfig
from hitchllm.kv_transfer.connector import KVTransferEvents
from hitchllm.kv_transfer.scheduling import KVTransferScheduling
from hitchllm.request import Request
from hitchllm.sampling_params import SamplingParams
from hitchllm.scheduler.policy import PreemptionPolicy
from hitchllm.scheduler.preemption import PreemptionMode
from hitchllm.scheduler.scheduler import Scheduler, SchedulerConfig


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_a_running_request_that_needs_a_loaded_requests_blocks_never_stalls(mode):
    kv = KVCacheManager(5, 2, enable_prefix_caching=False, num_host_blocks=8)
    transfers = KVTransferScheduling(
        KVTransferConfig(kv_connector="shared_memory", kv_role="consumer"), kv)
    # One request runs at a time, so the loaded one waits while the long one decodes.
    scheduler = Scheduler(SchedulerConfig(1, 64, 64, PreemptionPolicy.FCFS, mode), kv,
                          kv_transfer=transfers)
    long = Request("long", [10, 11], SamplingParams(max_tokens=8, ignore_eos=True))
    loaded = Request("loaded", [20, 21, 22], SamplingParams(max_tokens=2, ignore_eos=True))
    loaded.kv_transfer_params = {"remote_request_id": "p"}
    # The loaded request reserves its blocks first; the long one runs in the same step.
    scheduler.add_request(loaded)
    scheduler.add_request(long)
    for _ in range(40):
        plan = scheduler.schedule()
        # The engine's no-progress check: nothing to run, and no KV on its way.
        assert not (plan.is_empty and scheduler.has_unfinished_requests()
                    and not transfers.has_work()), "the scheduler stalled"
        events = KVTransferEvents(loads_ready=[load.request_id for load in plan.kv_loads])
        scheduler.update_kv_transfers(events)
        requests = [scheduler.requests[rid] for rid in plan.request_ids]
        scheduler.update_from_output(plan, requests, {rid: [7] for rid in plan.request_ids})
        if not scheduler.has_unfinished_requests():
            break
    assert long.num_output_tokens == 8 and loaded.num_output_tokens == 2
    assert scheduler.stats.num_preemptions > 0  # the long request did give way
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
