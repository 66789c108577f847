"""KV-cache sizing from a memory profile, with the card's memory readings faked (runs on CPU)."""

from __future__ import annotations

import pytest
import torch

from hitchllm.engine.cuda_graphs import DecodeGraphs, default_capture_sizes
from hitchllm.engine.kv_sizing import MemorySnapshot, cuda_kv_cache_bytes

GiB = 2**30
DEVICE = torch.device("cuda:0")


@pytest.fixture
def card(monkeypatch):
    """An 80 GiB card whose free/reserved/allocated readings the test sets."""
    state = {"free": 70 * GiB, "reserved": 4 * GiB, "allocated": 3 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: state["reserved"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: state["allocated"])
    return state


def test_budget_is_the_share_minus_peak_and_non_torch_memory(card):
    start = MemorySnapshot(free=75 * GiB, total=80 * GiB)  # 5 GiB held by others at start
    # Since start the process took 5 GiB: 4 GiB reserved by PyTorch, 1 GiB outside it.
    budget = cuda_kv_cache_bytes(DEVICE, start, peak_torch=3 * GiB, utilization=0.5)
    assert budget == 40 * GiB - 3 * GiB - 1 * GiB


def test_other_processes_leaving_too_little_is_an_error_naming_the_knob(card):
    card["free"] = 10 * GiB
    start = MemorySnapshot(free=15 * GiB, total=80 * GiB)  # others hold 65 GiB
    with pytest.raises(ValueError, match="other processes hold 65.00 GiB.*gpu_memory_util"):
        cuda_kv_cache_bytes(DEVICE, start, peak_torch=3 * GiB, utilization=0.9)


def test_a_model_bigger_than_its_share_is_an_error(card):
    start = MemorySnapshot(free=75 * GiB, total=80 * GiB)
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        cuda_kv_cache_bytes(DEVICE, start, peak_torch=9 * GiB, utilization=0.1)


def test_capture_sizes_and_padding():
    assert default_capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 24]
    assert default_capture_sizes(256)[-1] == 256 and len(default_capture_sizes(256)) == 35
    assert default_capture_sizes(3) == [1, 2, 3]
    graphs = DecodeGraphs(default_capture_sizes(20))
    assert [graphs.padded_size(n) for n in (1, 3, 5, 9, 17, 20, 21)] == [1, 4, 8, 16, 20, 20,
                                                                          None]
