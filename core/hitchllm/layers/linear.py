"""Linear layers that know their tensor-parallel slice and their stacked slots.

- ``ReplicatedLinear``: every rank holds the whole weight.
- ``ColumnParallelLinear``: rank ``r`` holds output rows ``[r * n, (r + 1) * n)``; the ranks'
  outputs concatenate to the full output.
- ``MergedColumnParallelLinear``: several column-parallel layers stacked along the output (a
  Llama MLP's gate and up projections: one matmul instead of two); slots ``0, 1, ...``.
- ``QKVParallelLinear``: the query, key and value projections stacked (slots ``"q"``, ``"k"``,
  ``"v"``), split by attention heads; when there are fewer KV heads than ranks each KV head
  is replicated on ``world_size // num_kv_heads`` ranks.
- ``RowParallelLinear``: rank ``r`` holds input columns ``[r * n, (r + 1) * n)`` and computes a
  partial output; the partial outputs sum (``distributed.all_reduce``) to the full output.

The weights themselves belong to the layer's linear method (``hitchllm.layers.method``), which
a quantization plugin may replace per layer. In a world of size 1 ``forward`` is one call of the
method's ``apply`` (one ``F.linear`` when unquantized): no copy, no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from hitchllm import distributed
from hitchllm.layers.method import (
    LinearMethod,
    QuantizationMethod,
    ShardId,
    UnquantizedLinearMethod,
    copy_checked,
    set_weight_attrs,
)


@dataclass(frozen=True)
class _Slot:
    """Where one checkpoint tensor goes along the output dimension: rows ``[offset, offset +
    size)`` of the parameter receive rows ``[index * size, (index + 1) * size)`` of a tensor
    that has ``full_size`` rows."""

    offset: int
    size: int
    full_size: int
    index: int

    def packed(self, pack_factor: int, shard_id: ShardId) -> _Slot:
        """The slot in the units of a parameter that packs ``pack_factor`` output rows into
        one element (``packed_dim``): every size and offset divided by the factor."""
        if pack_factor == 1:
            return self
        for what, value in (("offset", self.offset), ("size", self.size),
                            ("full size", self.full_size)):
            if value % pack_factor:
                raise ValueError(f"slot {shard_id!r} has {what} {value} along the output, not "
                                 f"a multiple of the parameter's pack factor {pack_factor}")
        return _Slot(self.offset // pack_factor, self.size // pack_factor,
                     self.full_size // pack_factor, self.index)


def _divide(total: int, world_size: int, what: str) -> int:
    if total % world_size:
        raise ValueError(f"{what} ({total}) is not divisible by the tensor-parallel world size "
                         f"({world_size})")
    return total // world_size


class LinearBase(nn.Module):
    """Shared by the linear layers: asks ``quant_config`` for the linear method, lets it create
    the weights, adds the bias, and loads checkpoint tensors into output-dimension slots."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        slots: dict[ShardId, _Slot],
        *,
        bias: bool,
        quant_config: QuantizationMethod | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = input_size_per_partition
        self.output_partition_sizes = output_partition_sizes
        self.tp_rank = distributed.tp_rank()
        self.tp_size = distributed.tp_world_size()
        self.prefix = prefix
        self._slots = slots
        method = quant_config.get_linear_method(self, prefix) if quant_config else None
        self.linear_method: LinearMethod = method or UnquantizedLinearMethod()
        dtype = torch.get_default_dtype()
        self.linear_method.create_weights(
            self, input_size_per_partition, output_partition_sizes, dtype, self.weight_loader
        )
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(
                torch.empty(sum(output_partition_sizes), dtype=dtype), requires_grad=False
            )
            set_weight_attrs(self.bias, weight_loader=self.weight_loader, output_dim=0)
        else:
            self.register_parameter("bias", None)
        stacked = tuple(k for k in slots if k is not None)
        if stacked:
            for param in self.parameters(recurse=False):
                # The loader reports a stacked parameter loaded once every slot is.
                param.shard_ids = stacked  # type: ignore[attr-defined]

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's part of ``loaded_weight`` (slot ``shard_id``; ``None`` is the whole
        stacked tensor, as a checkpoint that already fuses q/k/v stores it) into ``param``.

        A parameter whose ``packed_dim`` is its ``output_dim`` holds ``pack_factor`` output rows
        per element (int4 values packed in an int32): slots and rank slices are then counted
        in packed elements, and each must be a whole number of them."""
        dim = getattr(param, "output_dim", None)
        if dim is None:  # not along the output (a per-tensor scale): every slot holds it all
            copy_checked(param.data, loaded_weight)
            return
        pack = getattr(param, "pack_factor", 1) if getattr(param, "packed_dim", None) == dim else 1
        if shard_id is None and None not in self._slots:
            sizes = [slot.packed(pack, key).full_size for key, slot in self._slots.items()]
            if loaded_weight.shape[dim] != sum(sizes):
                raise ValueError(f"stacked tensor has {loaded_weight.shape[dim]} rows along "
                                 f"dimension {dim}, expected {sum(sizes)}")
            for key, part in zip(self._slots, loaded_weight.split(sizes, dim), strict=True):
                self.weight_loader(param, part, key)
            return
        if shard_id not in self._slots:
            raise ValueError(f"unknown slot {shard_id!r}; this layer has "
                             f"{[k for k in self._slots if k is not None]}")
        slot = self._slots[shard_id].packed(pack, shard_id)
        if loaded_weight.shape[dim] != slot.full_size:
            raise ValueError(f"shape {tuple(loaded_weight.shape)} has {loaded_weight.shape[dim]} "
                             f"rows along dimension {dim}, expected {slot.full_size}")
        copy_checked(param.data.narrow(dim, slot.offset, slot.size),
                     loaded_weight.narrow(dim, slot.index * slot.size, slot.size))


class ReplicatedLinear(LinearBase):
    """``y = x @ W.T + b`` with the whole weight on every rank."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool = False,
        quant_config: QuantizationMethod | None = None, prefix: str = "",
    ) -> None:
        slot = _Slot(0, output_size, output_size, 0)
        super().__init__(input_size, output_size, input_size, [output_size], {None: slot},
                         bias=bias, quant_config=quant_config, prefix=prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_method.apply(self, x, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output rows split over the ranks. ``gather_output`` concatenates the ranks' outputs
    (leave it off when a row-parallel layer follows, as in the MLP)."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool = False,
        gather_output: bool = False, quant_config: QuantizationMethod | None = None,
        prefix: str = "",
    ) -> None:
        tp, rank = distributed.tp_world_size(), distributed.tp_rank()
        size = _divide(output_size, tp, "output size")
        super().__init__(input_size, output_size, input_size, [size],
                         {None: _Slot(0, size, output_size, rank)},
                         bias=bias, quant_config=quant_config, prefix=prefix)
        self.gather_output = gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x, self.bias)
        if self.gather_output and self.tp_size > 1:
            out = distributed.all_gather(out, dim=-1)
        return out


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Column-parallel layers of sizes ``output_sizes`` stacked along the output; checkpoint
    tensor ``i`` loads with ``shard_id=i``. Each rank holds its slice of every slot, in slot
    order, so ``forward``'s output splits into the slots' local parts."""

    def __init__(
        self, input_size: int, output_sizes: list[int], *, bias: bool = False,
        quant_config: QuantizationMethod | None = None, prefix: str = "",
    ) -> None:
        tp, rank = distributed.tp_world_size(), distributed.tp_rank()
        sizes = [_divide(s, tp, f"output size of slot {i}") for i, s in enumerate(output_sizes)]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        slots: dict[ShardId, _Slot] = {
            i: _Slot(offsets[i], sizes[i], output_sizes[i], rank) for i in range(len(sizes))
        }
        LinearBase.__init__(self, input_size, sum(output_sizes), input_size, sizes, slots,
                            bias=bias, quant_config=quant_config, prefix=prefix)
        self.gather_output = False
        self.output_sizes = output_sizes


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections stacked (slots ``"q"``, ``"k"``, ``"v"``) and split by
    heads: each rank holds ``num_heads`` query heads and ``num_kv_heads`` key/value heads.

    With fewer KV heads than ranks, ranks ``[j * r, (j + 1) * r)`` (``r = world_size //
    total_num_kv_heads``) all hold KV head ``j``: the world size must then be a multiple of the
    KV head count (anything else is refused with both numbers)."""

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
        *, bias: bool = False, quant_config: QuantizationMethod | None = None, prefix: str = "",
    ) -> None:
        tp, rank = distributed.tp_world_size(), distributed.tp_rank()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        self.num_heads = _divide(total_num_heads, tp, "number of attention heads")
        if total_num_kv_heads >= tp:
            self.num_kv_heads = _divide(total_num_kv_heads, tp, "number of key/value heads")
            kv_index = rank
        else:
            if tp % total_num_kv_heads:
                raise ValueError(
                    f"{total_num_kv_heads} key/value heads cannot be replicated evenly over "
                    f"{tp} tensor-parallel ranks: use a world size that divides or is a "
                    "multiple of the number of key/value heads"
                )
            self.num_kv_heads = 1
            kv_index = rank // (tp // total_num_kv_heads)
        q_size, kv_size = self.num_heads * head_size, self.num_kv_heads * head_size
        slots: dict[ShardId, _Slot] = {
            "q": _Slot(0, q_size, total_num_heads * head_size, rank),
            "k": _Slot(q_size, kv_size, total_num_kv_heads * head_size, kv_index),
            "v": _Slot(q_size + kv_size, kv_size, total_num_kv_heads * head_size, kv_index),
        }
        output_size = (total_num_heads + 2 * total_num_kv_heads) * head_size
        LinearBase.__init__(self, hidden_size, output_size, hidden_size,
                            [q_size, kv_size, kv_size], slots,
                            bias=bias, quant_config=quant_config, prefix=prefix)
        self.gather_output = False


class RowParallelLinear(LinearBase):
    """Input columns split over the ranks; each rank's output is partial and the partial
    outputs sum to the full one. The bias is added on rank 0 only, so it is counted once in
    the sum. ``reduce_results`` sums across ranks in ``forward`` (``distributed.all_reduce``);
    turn it off to get this rank's partial output."""

    def __init__(
        self, input_size: int, output_size: int, *, bias: bool = False,
        reduce_results: bool = True, quant_config: QuantizationMethod | None = None,
        prefix: str = "",
    ) -> None:
        tp = distributed.tp_world_size()
        size = _divide(input_size, tp, "input size")
        super().__init__(input_size, output_size, size, [output_size],
                         {None: _Slot(0, output_size, output_size, 0)},
                         bias=bias, quant_config=quant_config, prefix=prefix)
        self.reduce_results = reduce_results

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's input columns of ``loaded_weight`` (along the parameter's
        ``input_dim``; a parameter without one, like the bias, is copied whole)."""
        if shard_id is not None:
            raise ValueError(f"a row-parallel layer has no stacked slots, got {shard_id!r}")
        dim = getattr(param, "input_dim", None)
        if dim is not None:
            size = param.shape[dim]
            if loaded_weight.shape[dim] != size * self.tp_size:
                raise ValueError(f"shape {tuple(loaded_weight.shape)} has "
                                 f"{loaded_weight.shape[dim]} columns along dimension {dim}, "
                                 f"expected {size * self.tp_size}")
            loaded_weight = loaded_weight.narrow(dim, self.tp_rank * size, size)
        copy_checked(param.data, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.linear_method.apply(self, x, self.bias if self.tp_rank == 0 else None)
        if self.reduce_results and self.tp_size > 1:
            out = distributed.all_reduce(out)
        return out
