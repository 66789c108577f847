"""The CPU engine's torch threads: every core the process may use (its CPU affinity, capped by
its cgroup's CPU quota, v2 or v1), unless ``cpu_threads`` / ``--cpu-threads``, vLLM's
``VLLM_CPU_OMP_THREADS_BIND`` or ``OMP_NUM_THREADS`` say otherwise."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hitchllm import LLM
from hitchllm.config import EngineConfig
from hitchllm.cpu_threads import (
    RESERVED_CPUS_ENV,
    THREADS_BIND_ENV,
    cgroup_cpu_quota,
    parse_cpu_list,
    resolve_cpu_threads,
    usable_cpus,
)
from hitchllm.entrypoints.cli import build_parser, engine_kwargs


def cgroup_v2(root: Path, limits: dict[str, str]) -> Path:
    """A cgroup v2 tree: ``cpu.max`` written at each relative path of ``limits``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu memory\n")
    for rel, text in limits.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(text + "\n")
    return root


def cgroup_v1(root: Path, quota: int, period: int = 100000) -> Path:
    (root / "cpu").mkdir(parents=True)
    (root / "cpu" / "cpu.cfs_quota_us").write_text(f"{quota}\n")
    (root / "cpu" / "cpu.cfs_period_us").write_text(f"{period}\n")
    return root


def test_cgroup_v2_quota(tmp_path):
    assert cgroup_cpu_quota(cgroup_v2(tmp_path, {".": "200000 100000"}), "/") == 2.0
    assert cgroup_cpu_quota(cgroup_v2(tmp_path / "m", {".": "max 100000"}), "/") is None
    # The tightest limit on the way from the process's cgroup up to the root counts.
    nested = cgroup_v2(tmp_path / "n", {"a": "50000 100000", "a/b": "300000 100000"})
    assert cgroup_cpu_quota(nested, "/a/b") == 0.5
    assert cgroup_cpu_quota(nested, "/a") == 0.5
    assert cgroup_cpu_quota(tmp_path / "empty", "/") is None  # no cgroup files at all


def test_cgroup_v1_quota(tmp_path):
    assert cgroup_cpu_quota(cgroup_v1(tmp_path / "q", 150000)) == 1.5
    assert cgroup_cpu_quota(cgroup_v1(tmp_path / "u", -1)) is None


def test_a_two_cpu_quota_on_a_64_core_host_gives_two_threads(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(64)))
    quota2 = cgroup_v2(tmp_path / "two", {".": "200000 100000"})
    assert usable_cpus(quota2) == 2
    assert usable_cpus(cgroup_v1(tmp_path / "v1", 250000)) == 2  # 2.5 CPUs: 2 threads
    assert usable_cpus(cgroup_v2(tmp_path / "half", {".": "50000 100000"})) == 1
    assert usable_cpus(tmp_path / "none") == 64
    # The affinity mask caps it too: 4 cores allowed under an 8-CPU quota.
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert usable_cpus(cgroup_v2(tmp_path / "eight", {".": "800000 100000"})) == 4
    env: dict[str, str] = {}
    assert resolve_cpu_threads(None, False, env, lambda: usable_cpus(quota2))[0] == 2
    # With the model on its own thread too (no core is reserved by default)...
    assert resolve_cpu_threads(None, True, env, lambda: usable_cpus(quota2))[0] == 2
    # ...unless one is asked for.
    assert resolve_cpu_threads(None, True, {RESERVED_CPUS_ENV: "1"},
                               lambda: usable_cpus(quota2))[0] == 1


def test_overrides_in_order(monkeypatch):
    usable = lambda: 16  # noqa: E731
    assert resolve_cpu_threads(3, True, {THREADS_BIND_ENV: "0-7", "OMP_NUM_THREADS": "5"},
                               usable) == (3, "cpu_threads")
    assert resolve_cpu_threads(None, True, {THREADS_BIND_ENV: "0-3,8", "OMP_NUM_THREADS": "5"},
                               usable) == (5, THREADS_BIND_ENV)
    assert resolve_cpu_threads(None, True, {THREADS_BIND_ENV: "auto", "OMP_NUM_THREADS": "5"},
                               usable) == (None, "OMP_NUM_THREADS")
    assert resolve_cpu_threads(None, False, {}, usable)[0] == 16
    assert resolve_cpu_threads(None, True, {}, usable)[0] == 16
    assert resolve_cpu_threads(None, True, {RESERVED_CPUS_ENV: "1"}, usable)[0] == 15
    assert resolve_cpu_threads(None, True, {}, lambda: 1)[0] == 1  # one core: it is shared
    assert resolve_cpu_threads(None, True, {RESERVED_CPUS_ENV: "0"}, usable)[0] == 16
    assert resolve_cpu_threads(None, False, {RESERVED_CPUS_ENV: "2"}, usable)[0] == 14
    assert resolve_cpu_threads(None, True, {RESERVED_CPUS_ENV: "4"}, lambda: 2)[0] == 1
    with pytest.raises(ValueError, match=RESERVED_CPUS_ENV):
        resolve_cpu_threads(None, True, {RESERVED_CPUS_ENV: "one"}, usable)


def test_core_lists():
    assert parse_cpu_list("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_cpu_list("2|4-5") == [2, 4, 5]  # vLLM's per-rank separator
    for bad in ("", "a-b", ","):
        with pytest.raises(ValueError, match=THREADS_BIND_ENV):
            parse_cpu_list(bad)


def test_cpu_threads_flag_and_config():
    args = build_parser().parse_args(["generate", "--cpu-threads", "3", "--prompt", "x"])
    assert engine_kwargs(args)["cpu_threads"] == 3
    with pytest.raises(ValueError, match="cpu_threads"):
        EngineConfig(cpu_threads=0)


def test_engine_sets_torch_threads(llama_path, monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    try:
        LLM(llama_path, cpu_threads=1)
        assert torch.get_num_threads() == 1
        monkeypatch.setattr("hitchllm.cpu_threads.usable_cpus", lambda: 3)
        LLM(llama_path, async_scheduling=False)
        assert torch.get_num_threads() == 3
        monkeypatch.setattr("hitchllm.cpu_threads.usable_cpus", lambda: 4)
        LLM(llama_path)  # the model on a thread of its own: every core still its own
        assert torch.get_num_threads() == 4
        monkeypatch.setenv(RESERVED_CPUS_ENV, "1")
        LLM(llama_path)  # one core left to the engine loop, as asked
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
