"""CUDA graphs for prompt and mixed steps, captured piece by piece around attention.

A step that holds prompt chunks cannot replay a decode graph: its attention depends on every
request's query and context lengths. Everything else in the forward (embedding, norms, GEMMs,
rotary, activation) depends only on the number of tokens, and run eagerly it costs the host
several times what it costs the device (about 110 elementwise kernel calls and 200 GEMM and
other launches a step for a 28-layer model). So the forward is captured per token count of a
ladder (``default_token_sizes``) as a chain of graphs that ends at each attention layer and
starts again after it: ``graph 0, attention 0, graph 1, ..., attention L-1, graph L``. At
replay the graphs run from the host in a few microseconds each and each layer's attention runs
eagerly between them on the step's real tokens, with the step's metadata.

A step of ``n`` tokens runs at the smallest captured size ``T >= n``: its inputs are padded
with token 0 at position 0, attention sees only the first ``n`` rows of ``q``, ``k``, ``v``
(the metadata describes the real batch) and returns zeros for the padding rows, and the rows
after ``n`` of the output are ignored. Every other operation of the forward acts on each row
alone, so the real rows are what an unpadded forward gives them. The runner pads such steps the
same way when the graphs are not captured (``enforce_eager``), so eager and graph runs launch
the very same kernels.

Capture splits the model at its ``Attention`` layers through the forward context's
``split_attention`` hook: at each call the running graph ends, the layer's inputs are recorded,
the next graph begins and the layer's output buffer is allocated in it. The recorded tensors
are aliases that do not keep their memory allocated (the graphs' memory pool reuses it as the
eager forward would), so the pieces of one size take the memory of one forward of that size,
and every size shares the pool with the decode graphs.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hitchllm import distributed
from hitchllm.attention import Attention, set_forward_context

logger = logging.getLogger(__name__)

# Smallest captured token count: smaller mixed steps pad to it.
MIN_TOKENS = 16


def default_token_sizes(max_tokens: int) -> list[int]:
    """16, 32, 64, 128, 192, 256, 384, 512, 768, ... (powers of two, and halfway points from 128
    on: a step pads by at most half) below ``max_tokens``, and ``max_tokens``."""
    sizes = {max_tokens}
    size = MIN_TOKENS
    while size < max_tokens:
        sizes.add(size)
        if size >= 128 and size * 3 // 2 < max_tokens:
            sizes.add(size * 3 // 2)
        size *= 2
    return sorted(sizes)


def can_split(model: nn.Module, layers: list[Attention]) -> str | None:
    """Why ``model``, whose attention layers are ``layers``, cannot run as pieces (None: it
    can): each layer must be a core ``Attention`` (whose forward honours ``split_attention``),
    no mixture-of-experts layer may turn dense under capture (``dense_under_capture``), and
    the model runs in one process (no tensor or pipeline parallel collectives between the
    pieces)."""
    if not layers:
        return "the model has no attention layers"
    odd = sorted({type(layer).__name__ for layer in layers
                  if type(layer).forward is not Attention.forward})
    if odd:
        return f"attention layers {', '.join(odd)} run their own forward"
    dense = sorted({type(m.moe_method).__name__ for m in model.modules()
                    if getattr(getattr(m, "moe_method", None), "dense_under_capture", False)})
    if dense:
        return (f"the experts' method {', '.join(dense)} runs every expert on every token "
                "under capture (install hitchllm-attention-triton for the fused MoE kernel)")
    rank = distributed.current_rank()
    if rank.world_size > 1:
        return "tensor and pipeline parallel ranks run prompt steps eagerly"
    return None


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory that does not keep that memory allocated."""
    storage = t.untyped_storage()
    alias_storage = torch._C._construct_storage_from_data_pointer(  # type: ignore[attr-defined]
        storage.data_ptr(), t.device, storage.nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        alias_storage, t.storage_offset(), t.shape, t.stride())


class RowAttention:
    """``split_attention`` hook of a padded eager or replayed step: attends over the first
    ``num_tokens`` rows with the step's metadata; the padding rows of the output are zero.
    ``into``, when set, is the output buffer to fill (a captured graph's input)."""

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens
        self.into: torch.Tensor | None = None

    def __call__(self, layer: Attention, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        n = self.num_tokens
        out = self.into
        if out is None:
            out = q.new_empty(q.shape[0], layer.num_heads * layer.head_size)
        out[:n].copy_(layer.attend(q[:n], k[:n], v[:n]))
        out[n:].zero_()
        return out


@dataclass
class _Boundary:
    """One attention call between two pieces: the layer and aliases of its inputs and of the
    output buffer the next piece reads."""

    layer: Attention
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass
class _Pieces:
    """The captured forward of one token count."""

    graphs: list[torch.cuda.CUDAGraph]
    boundaries: list[_Boundary]
    output: torch.Tensor


class _Splitter:
    """``split_attention`` hook while capturing: ends the running graph at each attention call
    and begins the next. With ``capture`` False (the warm-up forward before a capture) it only
    returns a zero output."""

    def __init__(self, pool: Any, capture: bool) -> None:
        self.pool = pool
        self.capture = capture
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.boundaries: list[_Boundary] = []

    def begin(self) -> None:
        if self.capture:
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(self.pool)
            self.graphs.append(graph)

    def end(self) -> None:
        if self.capture:
            self.graphs[-1].capture_end()

    def __call__(self, layer: Attention, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> torch.Tensor:
        shape = (q.shape[0], layer.num_heads * layer.head_size)
        if not self.capture:
            return q.new_zeros(shape)
        self.end()
        self.begin()
        out = q.new_empty(shape)  # in the next graph's memory: alive until that graph reads it
        self.boundaries.append(_Boundary(layer, _alias(q), _alias(k), _alias(v), _alias(out)))
        return out


class PieceGraphs:
    """Piecewise-captured forwards, one per token count of ``sizes``."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sorted(set(sizes))
        self._pieces: dict[int, _Pieces] = {}

    def padded_tokens(self, num_tokens: int) -> int | None:
        """The smallest size that holds ``num_tokens`` tokens (None: too many)."""
        i = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[i] if i < len(self.sizes) else None

    @property
    def captured(self) -> bool:
        """Whether ``capture`` ran (replays need it)."""
        return bool(self._pieces)

    def capture(self, forward: Callable[[int], torch.Tensor], pool: Any) -> None:
        """Capture ``forward(tokens)`` (the model over the runner's first ``tokens`` input
        buffers) at every size, largest first, into the graph memory pool ``pool``. Each size
        runs once uncaptured first, so compilation happens outside the capture."""
        start = time.perf_counter()
        reserved = torch.cuda.memory_reserved()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tokens in reversed(self.sizes):
                with set_forward_context(None, split_attention=_Splitter(pool, False)):
                    forward(tokens)
                torch.cuda.synchronize()
                # The uncaptured run's buffers, before the pool grows (the pool keeps its own).
                torch.cuda.empty_cache()
                splitter = _Splitter(pool, True)
                with set_forward_context(None, split_attention=splitter):
                    splitter.begin()
                    output = forward(tokens)
                    splitter.end()
                    self._pieces[tokens] = _Pieces(splitter.graphs, splitter.boundaries,
                                                   _alias(output))
                del output
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        num_graphs = sum(len(p.graphs) for p in self._pieces.values())
        logger.info("Captured %d CUDA graphs of prompt and mixed steps (%d pieces each, token "
                    "counts %s..%s) in %.1f s; their memory pool holds %.2f GiB",
                    len(self._pieces), num_graphs // len(self._pieces), self.sizes[0],
                    self.sizes[-1], time.perf_counter() - start,
                    (torch.cuda.memory_reserved() - reserved) / 2**30)

    def replay(self, tokens: int, num_tokens: int, attn_metadata: Any) -> torch.Tensor:
        """Run the pieces of size ``tokens`` for a step of ``num_tokens`` real tokens whose
        attention metadata is ``attn_metadata``; returns the output buffer ([tokens, hidden],
        rows past ``num_tokens`` are padding)."""
        pieces = self._pieces[tokens]
        rows = RowAttention(num_tokens)
        n = num_tokens
        with set_forward_context(attn_metadata, split_attention=rows, num_real_tokens=n):
            for graph, boundary in zip(pieces.graphs, pieces.boundaries):
                graph.replay()
                rows.into = boundary.out
                # Through the module call, so the layer's pre-hooks run as in an eager step
                # (its output is ``into``: a hook replacing it would not be seen).
                boundary.layer(boundary.q[:n], boundary.k[:n], boundary.v[:n])
            pieces.graphs[-1].replay()
        return pieces.output
