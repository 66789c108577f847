"""Per-step metrics: several observations of one value in one bucket update give the same
histogram as observing them one by one."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from hitchllm.entrypoints.openai.metrics import _observe_many

BUCKETS = (0.01, 0.1, 1.0)


def _histogram() -> tuple[CollectorRegistry, Histogram]:
    registry = CollectorRegistry()
    return registry, Histogram("gap_seconds", "gaps", buckets=BUCKETS, registry=registry)


@pytest.mark.parametrize("value", [0.0, 0.01, 0.05, 0.1, 0.7, 1.0, 3.0])
def test_observe_many_matches_observe(value):
    one_by_one, hist = _histogram()
    for _ in range(5):
        hist.observe(value)
    hist.observe(0.02)
    at_once, hist2 = _histogram()
    _observe_many(hist2, value, 5)
    _observe_many(hist2, 0.02, 1)
    assert _samples(at_once) == _samples(one_by_one)


def _samples(registry: CollectorRegistry) -> list[bytes]:
    """The exposition without its ``_created`` timestamps (they differ between registries)."""
    return [line for line in generate_latest(registry).splitlines() if b"_created" not in line]
