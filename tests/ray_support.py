"""Helpers of the Ray executor's tests: one local Ray cluster per test module, torn down
after it, and engines whose actors are checked gone after ``close``."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest
from tp_support import alive

# Ray's start-up takes seconds on 2 cores; each test also bounds its own run with this.
RAY_TEST_TIMEOUT_S = 90
# CPUs the test cluster offers: one bundle per rank of TP=2.
CLUSTER_CPUS = 2


def import_ray_or_skip():
    return pytest.importorskip(
        "ray", reason="Ray is not installed: pip install 'hitchllm[ray]' to run the Ray tests")


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[object]:
    """A local Ray instance of ``CLUSTER_CPUS`` CPUs for the module (never a cluster the
    machine may be running: ``address="local"``), shut down after its last test."""
    ray = import_ray_or_skip()
    ray.init(address="local", num_cpus=CLUSTER_CPUS, include_dashboard=False,
             log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture
def ray_test_timeout() -> Iterator[None]:
    """Fail the test (``TimeoutError`` in the main thread) if it runs past
    ``RAY_TEST_TIMEOUT_S``, rather than hang the suite (pytest-timeout is not installed)."""

    def expire(signum, frame):
        raise TimeoutError(f"the test ran past {RAY_TEST_TIMEOUT_S} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(RAY_TEST_TIMEOUT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def wait_gone(pids: list[int], limit_s: float = 15.0) -> list[int]:
    """The processes of ``pids`` still alive after up to ``limit_s`` (Ray kills actors
    asynchronously)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]
