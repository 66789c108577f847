"""Tensor-parallel rank and world size, and the collectives the parallel layers call.

Until the tensor-parallel issue brings ``torch.distributed``, every process is rank 0 of a world
of 1, and the layers in ``hitchllm.layers`` take their world-size-1 path (no collective, no
extra copy). The layers read the rank and world size when they are constructed, so a test can
build the layers of each rank of a pretend world inside ``tensor_parallel(rank, world_size)``
and check their slicing without any process group.

``all_reduce`` and ``all_gather`` are the hook points where the tensor-parallel issue plugs in
the real collectives; outside a world of 1 they refuse, so a layer never silently returns a
partial result.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

_rank = 0
_world_size = 1


def tp_rank() -> int:
    """This process's rank in its tensor-parallel group."""
    return _rank


def tp_world_size() -> int:
    """How many processes share each layer's weights."""
    return _world_size


@contextmanager
def tensor_parallel(rank: int, world_size: int) -> Iterator[None]:
    """Pretend to be ``rank`` of ``world_size`` while layers are built (tests of the slicing)."""
    global _rank, _world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of size {world_size}")
    previous = _rank, _world_size
    _rank, _world_size = rank, world_size
    try:
        yield
    finally:
        _rank, _world_size = previous


def _no_collectives(what: str) -> NotImplementedError:
    return NotImplementedError(
        f"{what} across {_world_size} ranks needs torch.distributed, which hitchllm does not set "
        "up yet: tensor parallelism is not available"
    )


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel group (row-parallel outputs)."""
    if _world_size == 1:
        return x
    raise _no_collectives("summing partial outputs")


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (column-parallel outputs)."""
    if _world_size == 1:
        return x
    raise _no_collectives("gathering output shards")
