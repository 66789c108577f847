"""Pipeline stages of a decoder: which layers a stage holds, and the hand-over between stages.

With ``pipeline_parallel_size=M`` the decoder layers split into M contiguous stages. When the
layers do not divide evenly, the first ``num_layers % M`` stages hold one layer more (the last
stage also runs the final norm, the LM head and sampling, so it is never the one that gets
more). Stage 0 embeds the tokens; the last stage holds the final norm and the LM head. A
stage builds nothing else: the other layers are ``AbsentLayer`` placeholders without
parameters (module names keep their checkpoint indices), and the checkpoint tensors of
modules a stage does not hold are skipped when it loads (``StageLayout.holds``).

Between stages the hidden state and the residual stream travel as one ``[2, tokens,
hidden]`` tensor, point-to-point (``hitchllm.distributed``). Every stage runs the same step
plan and prepares the same inputs, so a receiving stage knows the number of tokens (padding
included) without being told. Decode steps of a stage replay CUDA graphs of its layers; the
transfers stay outside them (``StageGraphIO``: the runner receives into the graph's input
before a replay and sends the graph's output after), and every stage pads a batch to the same
graph size, so the token counts still match.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from hitchllm import distributed, timeline

_LAYER_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """The decoder layers of stage ``pp_rank`` of ``pp_size`` (``ValueError`` when there are
    fewer layers than stages)."""
    if pp_size > num_layers:
        raise ValueError(
            f"pipeline_parallel_size={pp_size} is more than the model's {num_layers} decoder "
            f"layers (each stage needs at least one); use at most {num_layers}")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


@dataclass(frozen=True)
class StageLayout:
    """What one stage of a model holds; built while the model is constructed (it reads the
    rank set by ``hitchllm.distributed`` and the default dtype of the activations)."""

    pp_rank: int
    pp_size: int
    layers: range
    hidden_size: int
    dtype: torch.dtype

    @classmethod
    def current(cls, num_layers: int, hidden_size: int) -> StageLayout:
        """This process's stage of a model with ``num_layers`` decoder layers."""
        rank = distributed.current_rank()
        return cls(rank.pp_rank, rank.pp_size, stage_layers(num_layers, rank.pp_size,
                                                             rank.pp_rank),
                   hidden_size, torch.get_default_dtype())

    @property
    def is_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def holds(self, name: str) -> bool:
        """Whether the checkpoint tensor ``name`` belongs to a module this stage holds:
        its own layers', the embedding on the first stage, the final norm and the LM head
        on the last. Names outside the decoder (none in the Llama family) are kept."""
        match = _LAYER_NAME.search(name)
        if match is not None:
            return int(match.group(1)) in self.layers
        if "embed_tokens." in name:
            return self.is_first
        if name.startswith(("lm_head.", "model.norm.")):
            return self.is_last
        return True

    def receive(self, num_tokens: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous stage's hidden state and residual stream for ``num_tokens`` tokens
        (inside ``graph_transfers``: from its input buffer, which the runner fills)."""
        if _graph_io is not None:
            both = _graph_io.input(num_tokens)
            return both[0], both[1]
        return _receive(torch.empty((2, num_tokens, self.hidden_size), dtype=self.dtype,
                                    device=device))

    def send(self, hidden: torch.Tensor, residual: torch.Tensor) -> None:
        """Hand the hidden state and residual stream to the next stage (inside
        ``graph_transfers``: leave them for the runner to send)."""
        both = torch.stack((hidden, residual))
        if _graph_io is not None:
            _graph_io.outputs[both.shape[1]] = both
            return
        _send(both)


def _receive(into: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with timeline.device_span("recv"):
        distributed.recv_from_previous_stage(into)
    return into[0], into[1]


def _send(both: torch.Tensor) -> None:
    with timeline.device_span("send"):
        distributed.send_to_next_stage(both)


class StageGraphIO:
    """Where a pipeline stage's forward, captured in CUDA graphs, takes the previous stage's
    activations from and leaves its own: point-to-point transfers stay outside the graphs
    (a graph replays kernels, not a peer's timing). Before replaying the graph of
    ``num_tokens`` tokens the runner receives into ``input(num_tokens)`` (a stage after the
    first); after it, it sends ``outputs[num_tokens]`` (a stage before the last), the stacked
    hidden state and residual the graph wrote."""

    def __init__(self, max_tokens: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.hidden_size = hidden_size
        # One flat buffer: its first 2 x n x hidden elements are a contiguous [2, n, hidden]
        # for every n, which the transfer can write directly.
        self._input = torch.zeros(2 * max_tokens * hidden_size, dtype=dtype, device=device)
        # Keyed by token count: with one query length (pipeline stages run no speculative
        # decoding) every graph has its own.
        self.outputs: dict[int, torch.Tensor] = {}

    def input(self, num_tokens: int) -> torch.Tensor:
        """The [2, num_tokens, hidden] input of a graph of ``num_tokens`` tokens."""
        return self._input[: 2 * num_tokens * self.hidden_size].view(2, num_tokens,
                                                                      self.hidden_size)

    def receive(self, num_tokens: int) -> None:
        """Receive the previous stage's activations into the graph's input."""
        _receive(self.input(num_tokens))

    def send(self, num_tokens: int) -> None:
        """Send what the graph of ``num_tokens`` tokens left to the next stage."""
        _send(self.outputs[num_tokens])


# The graph I/O a stage's forward uses while it is captured (``graph_transfers``), else None.
_graph_io: StageGraphIO | None = None


@contextmanager
def graph_transfers(io: StageGraphIO) -> Iterator[None]:
    """While a stage's forward is captured: it reads its input from, and leaves its output
    in, ``io`` instead of receiving and sending."""
    global _graph_io
    _graph_io = io
    try:
        yield
    finally:
        _graph_io = None


def model_stage(model: nn.Module) -> StageLayout | None:
    """The pipeline stage a model was built as (None: a model that does not split)."""
    return next((stage for m in model.modules()
                 if isinstance(stage := getattr(m, "stage", None), StageLayout)), None)


class AbsentLayer(nn.Module):
    """Stands for a module another pipeline stage holds: no parameters, never called."""

    def forward(self, *args: object) -> torch.Tensor:
        raise RuntimeError("this module belongs to another pipeline stage")
