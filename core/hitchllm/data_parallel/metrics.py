"""``/metrics`` of a data-parallel server: the replicas' metrics merged into one set, named and
labelled as a one-engine server's (so dashboards need no change), plus the balancer's own
numbers per replica.

Merging: counters, histogram buckets, sums and counts and most gauges (running and waiting
requests) add up over the replicas; ``kv_cache_usage_perc`` (a fraction) is their mean;
``*_created`` timestamps take the earliest and ``*_info`` gauges (whose value is a time) the
latest. A replica that has stopped adds the counters and histograms it last reported, not its
gauges.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

# (name, documentation, type, unit, [(sample name, labels, value)]): a metric family as plain
# data, which pickles whatever prometheus_client's classes hold.
Family = tuple[str, str, str, str, list[tuple[str, dict[str, str], float]]]

_AVERAGED = {"hitchllm:kv_cache_usage_perc"}


def snapshot(registry: CollectorRegistry) -> list[Family]:
    """Every family of ``registry`` with its current samples."""
    return [(m.name, m.documentation, m.type, m.unit,
             [(s.name, dict(s.labels), s.value) for s in m.samples])
            for m in registry.collect()]


def without_gauges(families: list[Family]) -> list[Family]:
    """``families`` less the gauges: what a replica that has stopped still counts toward the
    totals (its counters and histograms), not the state it stopped in."""
    return [family for family in families if family[2] != "gauge"]


def _combine(family: str, kind: str, sample: str, values: list[float]) -> float:
    if sample.endswith("_created"):
        return min(values)
    if family in _AVERAGED:
        return sum(values) / len(values)
    if kind == "gauge" and family.endswith("_info"):
        return max(values)
    return sum(values)


def merge(snapshots: Iterable[list[Family]]) -> list[Metric]:
    """One family per name, each sample (name and labels) combined over the snapshots."""
    heads: dict[str, tuple[str, str, str]] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for families in snapshots:
        for name, doc, kind, unit, samples in families:
            heads.setdefault(name, (doc, kind, unit))
            into = values.setdefault(name, {})
            for sample, labels, value in samples:
                into.setdefault((sample, tuple(sorted(labels.items()))), []).append(value)
    merged = []
    for name, (doc, kind, unit) in heads.items():
        metric = Metric(name, doc, kind, unit)
        for (sample, labels), vals in values[name].items():
            metric.add_sample(sample, dict(labels), _combine(name, kind, sample, vals))
        merged.append(metric)
    return merged


class _Collector:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def render(families: list[Metric]) -> bytes:
    """``families`` in Prometheus' text format."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(families))  # type: ignore[arg-type]
    return generate_latest(registry)


class DataParallelMetrics:
    """What ``/metrics`` serves with data parallelism (a ``MetricsSource``)."""

    def __init__(self, model_name: str, num_replicas: int,
                 replica_snapshots: Callable[[], list[list[Family]]],
                 balancer_state: Callable[[], tuple[list[int], list[int], list[bool]]]) -> None:
        """``replica_snapshots``: every replica's families (a replica that cannot answer
        gives its last ones); ``balancer_state``: requests routed, in flight, and whether
        each replica is up."""
        self.model_name = model_name
        self.num_replicas = num_replicas
        self.replica_snapshots = replica_snapshots
        self.balancer_state = balancer_state

    def render(self) -> bytes:
        """The replicas' merged metrics, and the balancer's per replica (none for a single
        engine process: then ``/metrics`` is a one-engine server's)."""
        balancer = self._balancer_families() if self.num_replicas > 1 else []
        return render(merge(self.replica_snapshots()) + balancer)

    def _balancer_families(self) -> list[Metric]:
        routed, in_flight, alive = self.balancer_state()
        labels = ["model_name", "replica"]
        families: list[Any] = [
            CounterMetricFamily("hitchllm:data_parallel_requests_routed",
                                "Requests routed to each data-parallel replica.",
                                labels=labels),
            GaugeMetricFamily("hitchllm:data_parallel_requests_in_flight",
                              "Requests routed to each replica and not finished (its load).",
                              labels=labels),
            GaugeMetricFamily("hitchllm:data_parallel_replica_up",
                              "1 while the replica process serves, 0 once it has stopped.",
                              labels=labels),
        ]
        for i in range(self.num_replicas):
            for family, value in zip(families, (routed[i], in_flight[i], int(alive[i])),
                                     strict=True):
                family.add_metric([self.model_name, str(i)], value)
        return families
