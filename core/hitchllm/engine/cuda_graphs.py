"""CUDA graphs for decode steps.

A decode step at batch size 256 launches a few hundred small kernels; launching them one by one
from Python costs more than running them. The engine captures the model's forward once per
batch size of a ladder (1, 2, 4, 8, then every 8 up to the largest) and replays the graph of the
smallest captured size that holds the batch. The batch is padded up to that size with padding
requests (token 0 at position 0, slot -1 so nothing is written, context length 0).

Graphs read their inputs from the model runner's persistent buffers (``StepBuffers``) and the
attention backend's persistent metadata (see ``CudaGraphSupport``), so replay needs no
re-capture. All graphs share one memory pool; the largest is captured first.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


def default_capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_batch`` (which is always included)."""
    return sorted({*(s for s in (1, 2, 4) if s < max_batch), *range(8, max_batch, 8), max_batch})


class DecodeGraphs:
    """Captured decode forwards, one per padded batch size."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(set(sizes))
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}

    def padded_size(self, num_reqs: int) -> int | None:
        """The smallest capture size that holds ``num_reqs`` requests (None: too many)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def capture(
        self, prepare: Callable[[int], None], forward: Callable[[int], torch.Tensor]
    ) -> None:
        """Capture ``forward(size)`` for every size, after ``prepare(size)`` set up its inputs.

        Each size runs once eagerly first, so lazy initialisation (kernel compilation, cuBLAS
        workspaces) happens outside the capture.
        """
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            prepare(size)
            forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._outputs[size] = forward(size)
            self._graphs[size] = graph
        torch.cuda.synchronize()
        logger.info("Captured CUDA graphs for %d decode batch sizes (%s..%s) in %.1f s",
                    len(self.sizes), self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def replay(self, size: int) -> torch.Tensor:
        """Replay the graph of ``size``; returns its output buffer ([size, hidden])."""
        self._graphs[size].replay()
        return self._outputs[size]
