"""Device time of one call, measured the way the engine runs kernels: captured in a CUDA graph
(so Python launch overhead counts for no side) and timed with CUDA events over replays."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

CALLS_PER_GRAPH = 20


def graph_time_us(fn: Callable[[], object], repeats: int = 10,
                  calls_per_graph: int = CALLS_PER_GRAPH) -> float:
    """Median CUDA-event time of one call of ``fn``, over ``repeats`` replays of a graph of
    ``calls_per_graph`` calls (captured after three warm-up calls on a side stream, which
    compile Triton kernels and settle cuBLAS heuristics and the allocator)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    graph.replay()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls_per_graph)
    return sorted(times)[len(times) // 2]


def kernel_bench_args(argv: list[str] | None, doc: str | None,
                      ) -> tuple[argparse.Namespace, torch.device, int]:
    """The command line every kernel benchmark takes (``--device cuda|cpu``, ``--results``),
    parsed; the device; and the repeats per timing. ``--device cpu`` is a smoke run through
    Triton's interpreter, set up here before any kernel module is imported."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                        help="cpu: tiny shapes through Triton's interpreter (smoke run)")
    parser.add_argument("--results", type=Path, help="append the table to this file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU (or --device cpu for a smoke run)")
    if device.type == "cpu":
        # Read when the kernels are defined, hence before their module is first imported.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return args, device, 15 if device.type == "cuda" else 1


def device_time_us(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median time of one call: ``graph_time_us`` on a GPU; wall time on the CPU (smoke runs,
    whose times mean nothing)."""
    if device.type == "cuda":
        return graph_time_us(fn, repeats)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e6)
    return sorted(times)[len(times) // 2]
