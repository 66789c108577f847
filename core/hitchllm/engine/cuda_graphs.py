"""CUDA graphs for decode steps (and speculative verification steps).

A decode step at batch size 256 launches a few hundred small kernels; launching them one by one
from Python costs more than running them. The engine captures the model's forward once per
batch size of a ladder (1, 2, 4, 8, then every 8 up to the largest) and replays the graph of the
smallest captured size that holds the batch. The batch is padded up to that size with padding
requests (token 0 at position 0, slot -1 so nothing is written, context length 0).

Graphs read their inputs from the model runner's persistent buffers (``StepBuffers``) and the
attention backend's persistent metadata (see ``CudaGraphSupport``), so replay needs no
re-capture. All graphs share one memory pool; the largest is captured first. With tensor
parallelism the forward's all-reduces (NCCL, on the current stream, no host sync) are part of
the graphs. A pipeline stage's graphs hold its layers only: the runner receives the previous
stage's activations into the graph's input before a replay and sends its output after
(``hitchllm.models.pipeline.StageGraphIO``).

With a backend that supports it (``CudaGraphSupport.UNIFORM_BATCH``), batches where every
request has the same number ``q > 1`` of new tokens (a request's newest token and its K drafts)
are captured too, per query length, at the sizes whose ``size * q`` tokens fit the step; their
padding requests have ``q`` tokens each.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch

from hitchllm import distributed
from hitchllm.attention import AttentionBackend, CudaGraphSupport

logger = logging.getLogger(__name__)


def default_capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... up to ``max_batch`` (which is always included)."""
    return sorted({*(s for s in (1, 2, 4) if s < max_batch), *range(8, max_batch, 8), max_batch})


class DecodeGraphs:
    """Captured forwards, one per (padded batch size, tokens per request)."""

    def __init__(self, sizes: list[int], query_lens: tuple[int, ...] = (1,),
                 max_num_tokens: int | None = None) -> None:
        self.sizes = sorted(set(sizes))
        self.query_lens = tuple(sorted(set(query_lens)))
        limit = max_num_tokens or max(self.sizes, default=0)
        # The capture sizes of each query length: those whose tokens fit one step.
        self._sizes = {q: [s for s in self.sizes if s * q <= limit] for q in self.query_lens}
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}

    def padded_size(self, num_reqs: int, query_len: int = 1) -> int | None:
        """The smallest capture size that holds ``num_reqs`` requests of ``query_len`` new
        tokens each (None: too many, or no graphs for that query length)."""
        sizes = self._sizes.get(query_len, [])
        i = bisect.bisect_left(sizes, num_reqs)
        return sizes[i] if i < len(sizes) else None

    def capture(
        self, prepare: Callable[[int, int], None], forward: Callable[[int, int], torch.Tensor],
        pool: Any = None,
    ) -> None:
        """Capture ``forward(size, query_len)`` for every size and query length, after
        ``prepare(size, query_len)`` set up its inputs, into the graph memory pool ``pool``
        (default: a new one).

        Each runs once eagerly first, so lazy initialisation (kernel compilation, cuBLAS
        workspaces) happens outside the capture.
        """
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        # In a process group (tensor parallelism, whose all-reduces are captured too, or
        # pipeline stages) the NCCL watchdog thread keeps polling its events, and a stage's
        # answer thread waits for steps: only this thread's calls must be capture-safe.
        mode = "thread_local" if distributed.current_rank().world_size > 1 else "global"
        # Largest token count first: later graphs reuse its memory from the shared pool.
        keys = sorted(((s, q) for q, sizes in self._sizes.items() for s in sizes),
                      key=lambda k: -k[0] * k[1])
        for key in keys:
            prepare(*key)
            forward(*key)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                self._outputs[key] = forward(*key)
            self._graphs[key] = graph
        torch.cuda.synchronize()
        logger.info("Captured %d CUDA graphs (batch sizes %s..%s, tokens per request %s) "
                    "in %.1f s", len(keys), self.sizes[0], self.sizes[-1],
                    "/".join(map(str, self.query_lens)), time.perf_counter() - start)

    @property
    def max_tokens(self) -> int:
        """The most tokens of a graph (its padded batch size x tokens per request)."""
        return max((s * q for q, sizes in self._sizes.items() for s in sizes), default=0)

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def replay(self, size: int, query_len: int = 1) -> torch.Tensor:
        """Replay the graph of ``size`` requests of ``query_len`` tokens; returns its output
        buffer ([size * query_len, hidden])."""
        key = (size, query_len)
        self._graphs[key].replay()
        return self._outputs[key]


def graphs_for(
    backend: type[AttentionBackend], device: torch.device, sizes: list[int],
    max_num_seqs: int, max_num_tokens: int, query_lens: tuple[int, ...] = (1,),
) -> DecodeGraphs | None:
    """The graphs a runner of ``backend`` on ``device`` may capture (None: none): at the
    capture sizes that fit ``max_num_seqs`` and ``max_num_tokens``, for one-token decode
    batches and, where the backend supports uniform batches, for ``query_lens``."""
    support = backend.cuda_graph_support
    if device.type != "cuda" or support is CudaGraphSupport.NEVER:
        return None
    sizes = [s for s in sizes if s <= min(max_num_seqs, max_num_tokens)]
    if not sizes:
        return None
    lens = query_lens if support is CudaGraphSupport.UNIFORM_BATCH else (1,)
    return DecodeGraphs(sizes, lens, max_num_tokens)
