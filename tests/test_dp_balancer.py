"""The data-parallel load balancer's policy and the merging of replicas' metrics (no
processes: the policy and the merge are plain functions of their inputs)."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hitchllm.data_parallel.balancer import (
    BalancerPolicy,
    LoadBalancer,
    NoLiveReplicaError,
    prefix_keys,
)
from hitchllm.data_parallel.metrics import merge, render, snapshot

POLICY = BalancerPolicy(block_size=4, min_affinity_blocks=2, affinity_slack=2)


def prompt(prefix: int, length: int = 16, suffix: int = 0) -> list[int]:
    """``length`` tokens shared by every prompt of ``prefix``, then ``suffix``'s own."""
    return [prefix * 1000 + i for i in range(length)] + [suffix, suffix + 1]


def test_ties_go_round_robin_and_load_decides_otherwise():
    lb = LoadBalancer(3, POLICY)
    assert [lb.choose() for _ in range(3)] == [0, 1, 2]  # all tied: in turn
    assert lb.load == [1, 1, 1]
    lb.finished(1)
    assert lb.choose() == 1  # the least loaded, whatever the turn
    lb.finished(0)
    lb.finished(2)
    assert lb.choose() == 2  # 0 and 2 tied; the turn is past 1
    assert lb.choose() == 0
    assert lb.routed == [2, 2, 2] and lb.load == [1, 1, 1]


def test_a_repeated_prefix_goes_to_the_replica_that_served_it():
    lb = LoadBalancer(2, POLICY)
    first = lb.choose(prompt(7, suffix=1))
    lb.finished(first)
    # Without affinity the turn would move on to the other replica; sequential requests
    # sharing 4 blocks keep going where the blocks are cached.
    for suffix in range(2, 6):
        assert lb.choose(prompt(7, suffix=suffix)) == first
        lb.finished(first)
    assert lb.choose(prompt(8)) != first  # a new prefix: round robin moves on


def test_affinity_yields_to_load_beyond_the_slack():
    lb = LoadBalancer(2, POLICY)
    home = lb.choose(prompt(7))
    other = 1 - home
    for suffix in range(2):  # up to least + slack (0 + 2) requests in flight on home
        assert lb.choose(prompt(7, suffix=suffix + 10)) == home
    assert lb.load[home] == 3
    assert lb.choose(prompt(7, suffix=20)) == other  # 3 > 0 + 2: the idle replica wins
    # ... which now holds the prefix too, as its last server.
    assert lb.choose(prompt(7, suffix=21)) == other


def test_short_shared_prefixes_and_other_adapters_do_not_attract():
    lb = LoadBalancer(2, POLICY)
    a = lb.choose(prompt(7, length=4))  # one full block: below min_affinity_blocks
    assert lb.choose(prompt(7, length=4, suffix=9)) != a
    lb = LoadBalancer(2, POLICY)
    a = lb.choose(prompt(7), salt="adapter-a")
    lb.finished(a)
    assert lb.choose(prompt(7), salt="adapter-b") != a  # its blocks cannot be shared
    assert prefix_keys(prompt(7), "a", 4, 64) != prefix_keys(prompt(7), "b", 4, 64)
    assert len(prefix_keys(list(range(10)), None, 4, 64)) == 2  # full blocks only
    assert len(prefix_keys(list(range(100)), None, 4, 3)) == 3


def test_a_dead_replica_gets_nothing_and_none_left_is_an_error():
    lb = LoadBalancer(2, POLICY)
    home = lb.choose(prompt(7))
    lb.finished(home)
    lb.mark_dead(home)
    assert {lb.choose(prompt(7, suffix=s)) for s in range(3)} == {1 - home}
    lb.mark_dead(1 - home)
    with pytest.raises(NoLiveReplicaError):
        lb.choose()
    with pytest.raises(ValueError, match="at least 1"):
        LoadBalancer(0)


def replica_registry(tokens: float, running: int, usage: float, latencies: list[float]):
    """A registry shaped like a replica's ServerMetrics (a counter, gauges, a histogram)."""
    registry = CollectorRegistry()
    Counter("hitchllm:generation_tokens", "d", ["model_name"],
            registry=registry).labels("m").inc(tokens)
    Gauge("hitchllm:num_requests_running", "d", ["model_name"],
          registry=registry).labels("m").set(running)
    Gauge("hitchllm:kv_cache_usage_perc", "d", ["model_name"],
          registry=registry).labels("m").set(usage)
    h = Histogram("hitchllm:e2e_request_latency_seconds", "d", ["model_name"],
                  buckets=(0.1, 1.0), registry=registry)
    for value in latencies:
        h.labels("m").observe(value)
    return registry


def sample(text: str, line_start: str) -> float:
    match = re.search(rf"^{re.escape(line_start)} (\S+)$", text, re.M)
    assert match, line_start
    return float(match.group(1))


def test_merged_metrics_sum_counters_gauges_and_buckets_and_average_kv_usage():
    a = replica_registry(5, 2, 0.5, [0.05, 0.5])
    b = replica_registry(7, 1, 0.25, [0.05, 5.0, 5.0])
    text = render(merge([snapshot(a), snapshot(b)])).decode()
    assert sample(text, 'hitchllm:generation_tokens_total{model_name="m"}') == 12
    assert sample(text, 'hitchllm:num_requests_running{model_name="m"}') == 3
    assert sample(text, 'hitchllm:kv_cache_usage_perc{model_name="m"}') == 0.375
    bucket = 'hitchllm:e2e_request_latency_seconds_bucket{le="%s",model_name="m"}'
    assert [sample(text, bucket % le) for le in ("0.1", "1.0", "+Inf")] == [2, 3, 5]
    assert sample(text, 'hitchllm:e2e_request_latency_seconds_count{model_name="m"}') == 5
    assert sample(text, 'hitchllm:e2e_request_latency_seconds_sum{model_name="m"}') == \
        pytest.approx(10.6)
    created = [sample(render(merge([snapshot(r)])).decode(),
                      'hitchllm:generation_tokens_created{model_name="m"}') for r in (a, b)]
    assert sample(text, 'hitchllm:generation_tokens_created{model_name="m"}') == min(created)
