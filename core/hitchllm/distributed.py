"""Parallel ranks and world sizes, the process group, and the collectives the layers call.

A process that never calls ``init_distributed`` is rank 0 of a world of 1, and the layers in
``hitchllm.layers`` take their world-size-1 path (no collective, no extra copy). A worker of a
tensor-parallel engine calls ``init_distributed`` once at start-up, before it builds its model:
that joins the ``torch.distributed`` process group (gloo on CPU, NCCL on CUDA) and sets the
rank and world size the layers read when they are constructed.

Rank layout: a world of ``tp_size * pp_size`` processes, stage-major: global rank
``pp_rank * tp_size + tp_rank``, so the ranks of one pipeline stage are consecutive. Each
stage has its own tensor-parallel group (the whole world when there is one stage), inside
which the layers' all-reduce and all-gather run. Between stages, activations travel
point-to-point (``send_to_next_stage`` / ``recv_from_previous_stage``), each pair of
neighbouring ranks on a two-rank group of its own: tensor-parallel rank
``t`` of stage ``s`` sends to tensor-parallel rank ``t`` of stage ``s + 1`` (every rank of a
stage holds the whole, all-reduced hidden state).

``tensor_parallel(rank, world_size)`` (``pretend_rank`` for a stage too) pretends to be one
rank of a world without any process group, so that a test can build each rank's layers and
check their slicing; a collective called there refuses, so a layer never silently returns a
partial result.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelRank:
    """Where one worker sits: its tensor-parallel rank and size, its pipeline stage and the
    number of stages."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"rank {self.tp_rank} is outside a world of size {self.tp_size}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"stage {self.pp_rank} is outside {self.pp_size} pipeline stages")

    @property
    def global_rank(self) -> int:
        """The rank in the whole world (stage-major: a stage's TP ranks are consecutive)."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        """Whether this stage embeds the tokens (the first pipeline stage)."""
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        """Whether this stage holds the final norm and LM head, and samples."""
        return self.pp_rank == self.pp_size - 1

    @property
    def answers(self) -> bool:
        """Whether this rank sends the step's output to the driver: tensor-parallel rank 0
        of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    def describe(self) -> str:
        """How errors name this rank: ``tensor-parallel rank 1`` with one stage, else with
        its stage (``rank 3 (pipeline stage 1, tensor-parallel rank 1)``)."""
        if self.pp_size == 1:
            return f"tensor-parallel rank {self.tp_rank}"
        return (f"rank {self.global_rank} (pipeline stage {self.pp_rank}, tensor-parallel "
                f"rank {self.tp_rank})")

    @classmethod
    def of(cls, global_rank: int, tp_size: int, pp_size: int) -> ParallelRank:
        """The rank at ``global_rank`` of a ``tp_size`` x ``pp_size`` world."""
        return cls(tp_rank=global_rank % tp_size, tp_size=tp_size,
                   pp_rank=global_rank // tp_size, pp_size=pp_size)


_state = ParallelRank()
# The tensor-parallel process group once ``init_distributed`` ran; None in a pretend world.
_tp_group: dist.ProcessGroup | None = None
# With pipeline stages: the two-rank groups this rank receives activations on (from the
# previous stage) and sends them on (to the next); None where there is no such stage.
_prev_stage_group: dist.ProcessGroup | None = None
_next_stage_group: dist.ProcessGroup | None = None


def tp_rank() -> int:
    """This process's rank in its tensor-parallel group."""
    return _state.tp_rank


def tp_world_size() -> int:
    """How many processes share each layer's weights."""
    return _state.tp_size


def pp_rank() -> int:
    """This process's pipeline stage (0 without pipeline parallelism)."""
    return _state.pp_rank


def pp_world_size() -> int:
    """The number of pipeline stages (1 without pipeline parallelism)."""
    return _state.pp_size


def backend_for(device: torch.device) -> str:
    """The ``torch.distributed`` backend for tensors on ``device``: NCCL on CUDA, else gloo."""
    return "nccl" if device.type == "cuda" else "gloo"


@contextmanager
def tensor_parallel(rank: int, world_size: int) -> Iterator[None]:
    """Pretend to be ``rank`` of ``world_size`` while layers are built (tests of the slicing)."""
    with pretend_rank(ParallelRank(tp_rank=rank, tp_size=world_size)):
        yield


@contextmanager
def pretend_rank(rank: ParallelRank) -> Iterator[None]:
    """Pretend to be ``rank`` (its stage too) while a model is built: tests of which layers
    and slices a rank holds. Collectives and stage-to-stage transfers refuse there."""
    global _state
    previous = _state
    _state = rank
    try:
        yield
    finally:
        _state = previous


def init_distributed(
    rank: ParallelRank, device: torch.device, store: dist.Store, timeout_s: float
) -> None:
    """Join the process group through ``store`` (every rank of the world calls this) and
    become ``rank``. Collectives that wait longer than ``timeout_s`` for a peer fail."""
    global _state, _tp_group, _prev_stage_group, _next_stage_group
    if dist.is_initialized():
        raise RuntimeError("this process already belongs to a torch.distributed process group")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend_for(device), store=store, rank=rank.global_rank, world_size=rank.world_size,
        timeout=timedelta(seconds=timeout_s),
        device_id=device if device.type == "cuda" else None,
    )
    _state = rank
    _tp_group = dist.group.WORLD
    if rank.pp_size > 1:
        # Every rank takes part in creating every group; each keeps its own stage's.
        for stage in range(rank.pp_size):
            group = dist.new_group([stage * rank.tp_size + t for t in range(rank.tp_size)])
            if stage == rank.pp_rank:
                _tp_group = group
        # One group per pair of neighbouring ranks for the activations: on the world group
        # NCCL would run every stage-to-stage transfer as a collective of the whole world,
        # serialized with every other (a middle stage's receive of step k + 1 behind its
        # send of step k, which waits for the next stage), and warns so.
        for stage in range(rank.pp_size - 1):
            for t in range(rank.tp_size):
                sender = stage * rank.tp_size + t
                group = dist.new_group([sender, sender + rank.tp_size])
                if sender == rank.global_rank:
                    _next_stage_group = group
                elif sender + rank.tp_size == rank.global_rank:
                    _prev_stage_group = group


def destroy_distributed() -> None:
    """Leave the process group (a no-op when this process never joined one)."""
    global _state, _tp_group, _prev_stage_group, _next_stage_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _state, _tp_group = ParallelRank(), None
    _prev_stage_group = _next_stage_group = None


def current_rank() -> ParallelRank:
    """This process's place in the world (rank 0 of 1 outside a process group)."""
    return _state


def _group() -> dist.ProcessGroup:
    if _tp_group is None:
        raise RuntimeError(
            f"a collective across {_state.tp_size} tensor-parallel ranks was called outside a "
            "process group (inside ``tensor_parallel`` only the layers' slicing can be tested)"
        )
    return _tp_group


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of ``x`` over the tensor-parallel group (row-parallel outputs), in place.

    On NCCL this is queued on the current stream without a host sync, so it is captured into
    CUDA graphs with the rest of the forward."""
    if _state.tp_size == 1:
        return x
    dist.all_reduce(x, group=_group())
    return x


# torch 2.13 names the one-tensor all-gather all_gather_single (all_gather_into_tensor warns
# there); torch 2.11, on the GPU machine, only has all_gather_into_tensor.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` in rank order (column-parallel outputs)."""
    world = _state.tp_size
    if world == 1:
        return x
    dim = dim % x.dim()
    # Gathered along dimension 0 (every backend's form), then moved: [world * m, ..., n, ...]
    # -> [..., world * n, ...], rank r's block r-th along ``dim``.
    gathered = torch.empty((world * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(gathered, x.contiguous(), group=_group())
    stacked = gathered.view(world, *x.shape)
    return stacked.movedim(0, dim).reshape(*x.shape[:dim], world * x.shape[dim],
                                           *x.shape[dim + 1:])


def send_to_next_stage(x: torch.Tensor) -> None:
    """Send ``x`` to this tensor-parallel rank of the next pipeline stage (which calls
    ``recv_from_previous_stage`` with its shape and dtype)."""
    if _state.is_last_stage:
        raise RuntimeError(f"stage {_state.pp_rank} is the last pipeline stage: it has no next")
    _require_group()
    dist.send(x.contiguous(), dst=_state.global_rank + _state.tp_size, group=_next_stage_group)


def recv_from_previous_stage(into: torch.Tensor) -> torch.Tensor:
    """Receive into ``into`` (contiguous) the tensor this tensor-parallel rank of the previous
    pipeline stage sends (of its shape and dtype); returns ``into``."""
    if _state.is_first_stage:
        raise RuntimeError("stage 0 is the first pipeline stage: it has no previous")
    _require_group()
    dist.recv(into, src=_state.global_rank - _state.tp_size, group=_prev_stage_group)
    return into


def _require_group() -> None:
    if _tp_group is None:
        raise RuntimeError("pipeline stages exchange activations only inside a process group "
                           "(init_distributed)")
