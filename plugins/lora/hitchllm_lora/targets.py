"""Which linear layers of a model an adapter may target, and where each PEFT module lands.

PEFT names the checkpoint's modules (``model.layers.0.self_attn.q_proj``); the model stacks
some of them into one layer (q/k/v into ``qkv_proj``, gate/up into ``gate_up_proj``, as the
model class's ``STACKED`` mapping says). A ``Target`` is one such module: a layer, the slot
(shard id) it occupies and that slot's column range in the layer's output on this
tensor-parallel rank. Slicing an adapter's weights for this rank reuses the layer's own
``weight_loader``, so q/k/v heads and KV-head replication come out exactly as the base
weights do.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hitchllm.layers import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from hitchllm.layers.method import ShardId

SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")


@dataclass(frozen=True, eq=False)
class Target:
    """One adaptable module: slot ``shard_id`` of ``layer``, output columns ``[offset,
    offset + width)`` on this rank."""

    layer: LinearBase
    layer_prefix: str
    shard_id: ShardId
    offset: int
    width: int

    def local_weights(
        self, a: torch.Tensor, b: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's ``(A [r, in_local], B [width, r])`` of full PEFT weights ``a [r, in]``
        and ``b [out, r]``; ``ValueError`` when the shapes do not fit the layer."""
        rank = a.shape[0]
        layer = self.layer
        if isinstance(layer, RowParallelLinear):  # input split over ranks, output whole
            a_local = torch.zeros(rank, layer.input_size_per_partition, dtype=a.dtype)
            a_local.input_dim = 1  # type: ignore[attr-defined]
            layer.weight_loader(a_local, a)
            if tuple(b.shape) != (layer.output_size, rank):
                raise ValueError(f"lora_B has shape {tuple(b.shape)}, expected "
                                 f"{(layer.output_size, rank)}")
            return a_local, b.contiguous()
        if a.shape[1] != layer.input_size:
            raise ValueError(f"lora_A has {a.shape[1]} input columns, the layer has "
                             f"{layer.input_size}")
        rows = torch.zeros(sum(layer.output_partition_sizes), rank, dtype=b.dtype)
        rows.output_dim = 0  # type: ignore[attr-defined]
        layer.weight_loader(rows, b, self.shard_id)
        return a.contiguous(), rows[self.offset : self.offset + self.width].clone()


def _shard_ids(layer: LinearBase) -> list[ShardId]:
    """The layer's output slots in order (see ``hitchllm.layers.linear``)."""
    if isinstance(layer, QKVParallelLinear):
        return ["q", "k", "v"]
    if isinstance(layer, MergedColumnParallelLinear):
        return list(range(len(layer.output_sizes)))
    return [None]


def find_targets(model: nn.Module) -> dict[str, list[tuple[str, Target]]]:
    """Layer prefix -> its targets as ``(PEFT module name, Target)``, in output order, for
    every linear layer whose modules are all in ``SUPPORTED_TARGETS``."""
    stacked = getattr(model, "STACKED", {})
    checkpoint_name = {ours: name for name, ours in stacked.items()}
    found: dict[str, list[tuple[str, Target]]] = {}
    for prefix, layer in model.named_modules():
        if not isinstance(layer, LinearBase):
            continue
        parent, _, leaf = prefix.rpartition(".")
        shards = _shard_ids(layer)
        names = [leaf if s is None else checkpoint_name.get((leaf, s), "") for s in shards]
        if not all(n in SUPPORTED_TARGETS for n in names):
            continue
        offsets = [sum(layer.output_partition_sizes[:i]) for i in range(len(shards))]
        found[prefix] = [
            (f"{parent}.{name}" if parent else name,
             Target(layer, prefix, shard, offset, width))
            for name, shard, offset, width in zip(names, shards, offsets,
                                                   layer.output_partition_sizes, strict=True)
        ]
    return found
