"""How many CPU threads torch uses, and how they wait.

Two policies, both for an engine that shares its CPU (docs/performance.md, "CPU"):

- **Wait policy.** By default OpenMP's worker threads spin, busy-waiting for the next parallel
  region. On a CPU that other processes also use, spinning threads take turns with the threads
  doing the work and generation slowed down 7-30x in our measurements; passive waiting (the
  threads sleep in the kernel between regions) kept it within 1-3x of an idle machine. OpenMP
  reads ``OMP_WAIT_POLICY`` once, when torch loads it, so ``default_omp_wait_policy`` must run
  before ``import torch``.
- **Thread count.** torch starts one thread per core of the host, whatever share of it the
  process may use: in a container with a 2-CPU quota on a 64-core host that is 64 threads
  time-sliced onto 2 CPUs. ``usable_cpus`` counts the cores this process may run on (its CPU
  affinity) capped by its cgroup's CPU quota, and ``resolve_cpu_threads`` chooses the engine's
  torch threads from it: ``cpu_threads`` (``--cpu-threads``) first, then vLLM's
  ``VLLM_CPU_OMP_THREADS_BIND`` (a core list such as ``0-3,8``: its number of cores), then
  ``OMP_NUM_THREADS`` (torch has already read it), else every usable core less
  ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (default: ``DEFAULT_RESERVED_CPUS`` when the model runs on
  a thread of its own, overlapping the engine loop, else 0), at least one.

This module imports no torch: the command reads it before torch loads.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
# Cores left to the engine loop by default when the model runs on a thread of its own
# (overlap: scheduling, input preparation, detokenizing and building outputs run there while
# the model runs on the others). None: on a quiet 2-core machine the model on both cores was
# 25-40% faster than on one with a core left to the loop, and under a busy core it stayed
# within 0.7x of its quiet speed (docs/performance.md). Without overlap nothing is reserved
# either; VLLM_CPU_NUM_OF_RESERVED_CPU sets it.
DEFAULT_RESERVED_CPUS = 0
THREADS_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
RESERVED_CPUS_ENV = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def default_omp_wait_policy() -> bool:
    """Set ``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy or torch (and with it
    OpenMP) is already loaded; returns whether it was set."""
    if "OMP_WAIT_POLICY" in os.environ or "torch" in sys.modules:
        return False
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def cgroup_cpu_quota(root: Path = CGROUP_ROOT, cgroup_path: str | None = None) -> float | None:
    """The CPUs the process's cgroup may use per period (``2.0``: two CPUs' worth), from
    cgroup v2's ``cpu.max`` (the smallest from the process's cgroup, ``cgroup_path`` below
    ``root`` (default: read from ``/proc/self/cgroup``), up to ``root``) or cgroup v1's
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``; None when there is no quota (or no cgroup
    file to read)."""
    if (root / "cgroup.controllers").is_file() or (root / "cpu.max").is_file():  # v2
        path = _own_cgroup_v2() if cgroup_path is None else cgroup_path
        quotas = []
        directory = root / path.strip("/")
        while True:
            limit = directory / "cpu.max"
            if limit.is_file():
                quota, _, period = limit.read_text().strip().partition(" ")
                if quota != "max":
                    quotas.append(_quota(quota, period or "100000", limit))
            if directory == root or root not in directory.parents:
                break
            directory = directory.parent
        found = [q for q in quotas if q is not None]
        return min(found) if found else None
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        quota_file = v1 / "cpu.cfs_quota_us"
        if quota_file.is_file():
            quota = quota_file.read_text().strip()
            if int(quota) < 0:  # -1: unlimited
                return None
            return _quota(quota, (v1 / "cpu.cfs_period_us").read_text().strip(), quota_file)
    return None


def _own_cgroup_v2() -> str:
    """This process's cgroup v2 path (``0::/path`` in ``/proc/self/cgroup``), else ``/``."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return "/"
    return next((line[3:] for line in lines if line.startswith("0::")), "/")


def _quota(quota: str, period: str, source: Path) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        logger.warning("cannot read the CPU quota in %s (%r / %r); ignoring it", source,
                       quota, period)
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus(
    root: Path = CGROUP_ROOT,
    affinity: Callable[[int], set[int]] | None = None,
) -> int:
    """The cores this process may keep busy: its CPU affinity (``os.sched_getaffinity``,
    else ``os.cpu_count``), capped by its cgroup CPU quota rounded down (at least 1)."""
    get_affinity = affinity or getattr(os, "sched_getaffinity", None)
    cores = len(get_affinity(0)) if get_affinity is not None else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        cores = min(cores, math.floor(quota))
    return max(1, cores)


def parse_cpu_list(text: str) -> list[int]:
    """A core list such as ``0-3,8`` (vLLM's ``VLLM_CPU_OMP_THREADS_BIND``) to its cores;
    ``ValueError`` naming the variable when it is not one."""
    cores: list[int] = []
    try:
        for part in text.replace("|", ",").split(","):
            part = part.strip()
            if not part:
                continue
            first, _, last = part.partition("-")
            cores += range(int(first), int(last or first) + 1)
    except ValueError:
        cores = []
    if not cores:
        raise ValueError(f"{THREADS_BIND_ENV}={text!r} is not a core list; write e.g. 0-3 or "
                         "0,2,4 (or unset it, or pass --cpu-threads N)")
    return sorted(set(cores))


def resolve_cpu_threads(
    cpu_threads: int | None,
    overlap: bool = False,
    environ: dict[str, str] | os._Environ[str] = os.environ,
    usable: Callable[[], int] | None = None,
) -> tuple[int | None, str]:
    """The torch threads for a CPU engine and where the number comes from; None (with the
    reason) when torch's own choice stands (``OMP_NUM_THREADS`` is set). ``overlap``: the
    model runs on a thread of its own while the engine loop works (a core is left to the
    loop). ``usable`` counts the usable cores (default ``usable_cpus``)."""
    if cpu_threads is not None:
        return cpu_threads, "cpu_threads"
    bind = environ.get(THREADS_BIND_ENV, "").strip()
    if bind and bind not in ("auto", "all", "nobind"):
        return len(parse_cpu_list(bind)), THREADS_BIND_ENV
    if environ.get("OMP_NUM_THREADS"):
        return None, "OMP_NUM_THREADS"
    reserved_text = environ.get(RESERVED_CPUS_ENV)
    try:
        reserved = (int(reserved_text) if reserved_text is not None
                    else DEFAULT_RESERVED_CPUS if overlap else 0)
    except ValueError:
        raise ValueError(f"{RESERVED_CPUS_ENV}={reserved_text!r} is not a number of cores; "
                         "write e.g. 1 (or unset it)") from None
    cores = (usable or usable_cpus)()
    return max(1, cores - reserved), f"{cores} usable cores less {reserved} reserved"


def apply_cpu_threads(cpu_threads: int | None, overlap: bool) -> int:
    """Give torch the threads ``resolve_cpu_threads`` chooses; returns torch's thread count."""
    import torch

    threads, source = resolve_cpu_threads(cpu_threads, overlap)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
    logger.info("CPU: %d torch threads (%s), OMP_WAIT_POLICY=%s", torch.get_num_threads(),
                source, os.environ.get("OMP_WAIT_POLICY", "unset"))
    return torch.get_num_threads()
