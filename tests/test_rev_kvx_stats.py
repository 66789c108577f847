"""Review: a consumer's requests that wait for their KV are waiting requests in the engine's
stats and on /metrics (``num_requests_waiting``), not in neither count: a consumer busy
receiving a burst of requests showed 0 running and 0 waiting."""

from __future__ import annotations

from test_kvx_engine import GREEDY, PROMPTS, prefill, shm_pair

from hitchllm.entrypoints.openai.metrics import ServerMetrics
from hitchllm.request import RequestStatus

__all__ = ["shm_pair"]  # a fixture used here


def test_requests_waiting_for_their_kv_count_as_waiting(shm_pair):
    producer, consumer, _ = shm_pair
    [params] = prefill(producer, PROMPTS[:1])
    missing = {**params, "remote_request_id": "never-saved"}
    ids = [consumer.add_request({"prompt_token_ids": p}, GREEDY, kv_transfer_params=missing)
           for p in PROMPTS[:1] * 2]
    consumer.step()
    assert all(consumer.scheduler.requests[rid].status
               is RequestStatus.WAITING_FOR_REMOTE_KV for rid in ids)
    stats = consumer.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 2)
    metrics = ServerMetrics("tiny")
    metrics.observe(consumer, [], 0.0)
    assert 'hitchllm:num_requests_waiting{model_name="tiny"} 2.0' in metrics.render().decode()
    consumer.abort_request(ids)
    assert consumer.stats().num_waiting == 0
