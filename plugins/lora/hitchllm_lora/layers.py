"""Adapter-aware linear layers: each adaptable layer's linear method is wrapped so that its
output gains the LoRA term of every token's adapter.

The wrapper (``LoRALinearMethod``) keeps the layer's own method (unquantized or a
quantization plugin's) for the base product and adds, per output slot (q/k/v, gate/up, or the
whole output), ``lora_expand(lora_shrink(x, A), B)`` into that slot's columns. A row-parallel
layer adds its partial LoRA term before the layer's all-reduce, which then sums it with the
base output: ``sum_r (x_r A_r^T) B^T = (x A^T) B^T``.

Each slot's adapter weights live in a stacked pool allocated once per layer (``A [S, R,
H_in]``, ``B [S, N, R]`` for ``S = max_loras`` adapter slots and ``R = max_lora_rank``), so
a CUDA graph captured at start-up reads whatever adapters are active when it replays.

On CUDA the products run as the grouped Triton kernels of ``hitchllm_lora.kernels``; the
tokens are grouped by slot once per forward, by the first adapted layer the forward runs
(inside the forward, so a captured graph regroups on every replay), and every other layer
reuses the grouping. Elsewhere they run as the torch ops of ``hitchllm_lora.ops``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from hitchllm.layers import LinearBase, LinearMethod, WeightLoader
from hitchllm_lora import ops
from hitchllm_lora.targets import Target

if TYPE_CHECKING:
    from hitchllm_lora.slots import AdapterSlots


@dataclass(eq=False)
class SlicePool:
    """The pooled adapter weights of one output slot of a layer."""

    target: Target
    a: torch.Tensor  # [S, R, H_in_local]
    b: torch.Tensor  # [S, width, R]


class LayerLoRA:
    """The adapter pools of one layer and the per-token slot state they are applied with."""

    def __init__(
        self, targets: list[Target], slots: AdapterSlots, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.prefix = targets[0].layer_prefix
        self.slots = slots
        # Set by ``wrap_layers`` on the first adapted layer in the model's order: it groups
        # the forward's tokens by slot for every layer (CUDA).
        self.groups_tokens = False
        num_slots = slots.num_slots
        in_size = targets[0].layer.input_size_per_partition
        self.slices = [
            SlicePool(t, torch.zeros(num_slots, max_rank, in_size, dtype=dtype, device=device),
                      torch.zeros(num_slots, t.width, max_rank, dtype=dtype, device=device))
            for t in targets
        ]

    def add_lora(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """Add every token's adapter term into ``out`` (``[T, N_local]``) for input ``x``
        (``[T, H_in_local]``)."""
        slots = self.slots
        if not slots.in_use:
            return
        token_slot = slots.token_slot[: x.shape[0]]
        if not x.is_cuda:
            for pool in self.slices:
                y = ops.lora_shrink(x, pool.a, token_slot, slots.scaling)
                ops.lora_expand(y, pool.b, token_slot, out, pool.target.offset)
            return
        # Imported here, not at module level: Triton's import costs a CPU engine's start-up
        # 0.15-0.25 s, and only CUDA runs these kernels.
        from hitchllm_lora import kernels

        if self.groups_tokens or slots.groups is None:
            slots.groups = kernels.group_tokens(token_slot, slots.num_slots)
        for pool in self.slices:
            y = kernels.lora_shrink(x, pool.a, token_slot, slots.scaling, groups=slots.groups)
            kernels.lora_expand(y, pool.b, token_slot, out, pool.target.offset,
                                groups=slots.groups)


class LoRALinearMethod(LinearMethod):
    """A layer's linear method plus its LoRA term (see the module docstring)."""

    def __init__(self, base: LinearMethod, lora: LayerLoRA) -> None:
        self.base = base
        self.lora = lora

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int,
        output_partition_sizes: list[int], params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        self.base.create_weights(layer, input_size_per_partition, output_partition_sizes,
                                 params_dtype, weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        self.base.process_weights_after_loading(layer)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.base.apply(layer, x, bias)
        self.lora.add_lora(x, out)
        return out


def wrap_layers(
    targets: dict[str, list[Target]], slots: AdapterSlots, max_rank: int, dtype: torch.dtype,
    device: torch.device,
) -> list[LayerLoRA]:
    """Give every layer in ``targets`` (layer prefix -> its targets) its pools and wrap its
    linear method; returns the layers' pools."""
    wrapped = []
    for layer_targets in targets.values():
        layer: LinearBase = layer_targets[0].layer
        lora = LayerLoRA(layer_targets, slots, max_rank, dtype, device)
        layer.linear_method = LoRALinearMethod(layer.linear_method, lora)
        wrapped.append(lora)
    if wrapped:  # ``targets`` follows the model's module order, the order a forward runs
        wrapped[0].groups_tokens = True
    return wrapped
