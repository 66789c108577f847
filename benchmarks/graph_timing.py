"""Device time of one call, measured the way the engine runs kernels: captured in a CUDA graph
(so Python launch overhead counts for no side) and timed with CUDA events over replays."""

from __future__ import annotations

from collections.abc import Callable

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
