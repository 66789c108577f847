"""The mixture-of-experts layer: every expert's gated MLP stacked in two weights, and a
swappable *MoE method* that computes the routed sum.

``FusedMoE`` holds ``w13_weight [E, 2 * I, H]`` (each expert's gate rows, then its up rows)
and ``w2_weight [E, H, I]`` (down). A checkpoint stores one tensor per expert and projection
(``experts.{e}.gate_proj.weight`` in Qwen-MoE and DeepSeek, ``experts.{e}.w1.weight`` in
Mixtral); ``expert_route`` names the slot ``(e, "gate" | "up" | "down")`` each goes to, and the
layer's ``weight_loader`` places it there (this rank's slice of the intermediate dimension
under tensor parallelism: gate/up rows, down columns, outputs summed over ranks).

``forward(hidden [T, H], topk_weights [T, k], topk_ids [T, k])`` returns ``sum_j
topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t])``. The layer's ``MoEMethod`` computes
it; it is chosen like a linear method: ``quant_config.get_moe_method(layer, prefix)`` when the
quantization method has one, else ``UnquantizedMoEMethod`` (plain PyTorch), which a plugin may
swap in ``hitchllm_model_loaded`` for a kernel on the same weights (the attention_triton
plugin's fused Triton MoE on CUDA). The routing
functions (``softmax_topk``, ``grouped_topk``, from ``hitchllm.layers.moe_routing``) give the
top-k weights and ids from router logits.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from hitchllm import distributed
from hitchllm.layers.loading import Route
from hitchllm.layers.method import (
    QuantizationMethod,
    ShardId,
    WeightLoader,
    copy_checked,
    set_weight_attrs,
)
from hitchllm.layers.moe_routing import grouped_topk, softmax_topk

__all__ = ["FusedMoE", "MoEMethod", "UnquantizedMoEMethod", "expert_route", "grouped_topk",
           "softmax_topk"]

EXPERT_SLOTS = ("gate", "up", "down")


class MoEMethod(ABC):
    #: Whether ``apply``, while a CUDA graph is being captured, runs every expert on every
    #: token (capture-safe, but dense): fine for decode batches, too slow for prompt steps,
    #: so the engine then captures no piecewise graphs of prompt steps.
    dense_under_capture: bool = False

    """How a ``FusedMoE`` layer holds its experts' weights and computes the routed sum. A
    fused kernel (Triton) or a quantization plugin subclasses it."""

    @abstractmethod
    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int,
        intermediate_size_per_partition: int, params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register the layer's parameters, named ``w13_<suffix>`` (gate and up) and
        ``w2_<suffix>`` (down) so that checkpoint tensor ``experts.{e}.<proj>.<suffix>``
        routes to them, each with ``set_weight_attrs(param, weight_loader=weight_loader,
        output_dim=..., input_dim=...)`` counted per expert (dimension 0 of an expert's
        slice, ``param[e]``, is its output)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after loading (repack for a kernel here). The default does nothing."""
        return

    @abstractmethod
    def apply(
        self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        """This rank's routed sum ``[T, H]`` (partial over the intermediate dimension under
        tensor parallelism; the layer reduces it)."""


class UnquantizedMoEMethod(MoEMethod):
    """Weights in the model dtype; computed in plain torch, one pair of matmuls per expert
    over the tokens routed to it (tokens sorted by expert), summed in expert order.

    That path reads the per-expert token counts on the host, which a CUDA graph capture cannot
    do; while a graph is captured every expert runs densely on all tokens of the (small,
    decode) batch with a zero weight for the tokens not routed to it."""

    dense_under_capture = True

    def create_weights(
        self, layer: nn.Module, num_experts: int, hidden_size: int,
        intermediate_size_per_partition: int, params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        inter = intermediate_size_per_partition
        w13 = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden_size, dtype=params_dtype),
                           requires_grad=False)
        w2 = nn.Parameter(torch.empty(num_experts, hidden_size, inter, dtype=params_dtype),
                          requires_grad=False)
        for param in (w13, w2):
            set_weight_attrs(param, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("w13_weight", w13)
        layer.register_parameter("w2_weight", w2)

    def apply(
        self, layer: nn.Module, hidden: torch.Tensor, topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
    ) -> torch.Tensor:
        if hidden.is_cuda and torch.cuda.is_current_stream_capturing():
            return dense_experts(hidden, topk_weights, topk_ids, layer.w13_weight,
                                 layer.w2_weight)
        return grouped_experts(hidden, topk_weights, topk_ids, layer.w13_weight, layer.w2_weight)


def _expert_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w2)


def grouped_experts(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13: torch.Tensor, w2: torch.Tensor,
) -> torch.Tensor:
    """The routed sum with the (token, expert) pairs sorted by expert: each expert multiplies
    only its own rows. One host read of the per-expert counts."""
    top_k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    weights = topk_weights.reshape(-1)[order].float().unsqueeze(1)
    rows = hidden[tokens]
    ends = torch.bincount(flat_ids, minlength=w13.shape[0]).cumsum(0).tolist()
    out = torch.zeros_like(hidden)
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            y = _expert_mlp(rows[start:end], w13[expert], w2[expert])
            out.index_add_(0, tokens[start:end], (y * weights[start:end]).to(out.dtype))
        start = end
    return out


def dense_experts(
    hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13: torch.Tensor, w2: torch.Tensor,
) -> torch.Tensor:
    """The routed sum with every expert on every token (weight zero where not routed): no
    host synchronization, for CUDA graph capture of small batches."""
    num_experts = w13.shape[0]
    combine = torch.zeros(hidden.shape[0], num_experts, dtype=torch.float32,
                          device=hidden.device)
    combine.scatter_add_(1, topk_ids, topk_weights.float())
    out = torch.zeros_like(hidden)
    for expert in range(num_experts):
        y = _expert_mlp(hidden, w13[expert], w2[expert])
        out += (y * combine[:, expert:expert + 1]).to(out.dtype)
    return out


class FusedMoE(nn.Module):
    """``num_experts`` gated MLPs ``hidden_size -> intermediate_size -> hidden_size`` and the
    routed sum over them; see the module docstring. ``activation`` is the config's
    ``hidden_act``; only ``"silu"`` is supported.

    ``reduce_results`` sums the ranks' partial outputs (``distributed.all_reduce``) under
    tensor parallelism; turn it off to add a shared expert's partial output first.
    """

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, *,
        activation: str = "silu", reduce_results: bool = True,
        quant_config: QuantizationMethod | None = None, prefix: str = "",
        method: MoEMethod | None = None,
    ) -> None:
        super().__init__()
        if activation != "silu":
            raise ValueError(f"expert activation {activation!r} is not supported (only silu)")
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.tp_rank = distributed.tp_rank()
        self.tp_size = distributed.tp_world_size()
        if intermediate_size % self.tp_size:
            raise ValueError(f"expert intermediate size ({intermediate_size}) is not divisible "
                             f"by the tensor-parallel world size ({self.tp_size})")
        self.intermediate_size_per_partition = intermediate_size // self.tp_size
        self.reduce_results = reduce_results
        self.prefix = prefix
        get_moe_method = getattr(quant_config, "get_moe_method", None)
        if method is None and get_moe_method is not None:
            method = get_moe_method(self, prefix)
        self.moe_method: MoEMethod = method or UnquantizedMoEMethod()
        self.moe_method.create_weights(self, num_experts, hidden_size,
                                       self.intermediate_size_per_partition,
                                       torch.get_default_dtype(), self.weight_loader)
        for name, param in self.named_parameters(recurse=False):
            slots = ("gate", "up") if name.startswith("w13_") else ("down",)
            # The loader reports a stacked parameter loaded once every expert's slot is.
            param.shard_ids = tuple(  # type: ignore[attr-defined]
                (e, s) for e in range(num_experts) for s in slots)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's part of one expert's checkpoint tensor into slot ``shard_id =
        (expert, "gate" | "up" | "down")`` of ``param``."""
        if not (isinstance(shard_id, tuple) and len(shard_id) == 2
                and shard_id[1] in EXPERT_SLOTS and 0 <= shard_id[0] < self.num_experts):
            raise ValueError(f"expert slot {shard_id!r} is not (expert in 0..{self.num_experts - 1}"
                             f", one of {EXPERT_SLOTS})")
        expert, slot = shard_id
        dst = param.data[expert]
        out_dim = getattr(param, "output_dim", None)
        in_dim = getattr(param, "input_dim", None)
        # The intermediate dimension is split over ranks: gate/up along their output, down
        # along its input. Per-tensor values (no such dimension) are copied whole.
        split_dim = out_dim if slot != "down" else in_dim
        if split_dim is not None:
            size = dst.shape[split_dim] // (2 if slot != "down" else 1)
            if loaded_weight.shape[split_dim] != size * self.tp_size:
                raise ValueError(f"expert {expert} {slot}: shape {tuple(loaded_weight.shape)} "
                                 f"has {loaded_weight.shape[split_dim]} along dimension "
                                 f"{split_dim}, expected {size * self.tp_size}")
            loaded_weight = loaded_weight.narrow(split_dim, self.tp_rank * size, size)
            if slot != "down":
                dst = dst.narrow(split_dim, 0 if slot == "gate" else size, size)
        copy_checked(dst, loaded_weight)

    def forward(
        self, hidden: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
    ) -> torch.Tensor:
        out = self.moe_method.apply(self, hidden, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = distributed.all_reduce(out)
        return out


_EXPERT_NAME = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>\w+?)\."
                          r"(?P<suffix>[A-Za-z_]\w*)$")


def expert_route(
    gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj",
    module: tuple[str, str] | None = None,
) -> Route:
    """A ``route`` for ``load_named_weights``: checkpoint tensor ``<layer>.experts.{e}.<proj>.
    <suffix>`` goes to ``<layer>.experts.w13_<suffix>`` (``gate``, ``up`` projections) or
    ``<layer>.experts.w2_<suffix>`` (``down``), slot ``(e, "gate" | "up" | "down")``.

    Mixtral: ``expert_route("w1", "w3", "w2", module=("block_sparse_moe", "mlp"))``, where
    ``module`` renames the last part of ``<layer>`` (the checkpoint's ``block_sparse_moe`` is
    the model's ``mlp``)."""
    slots = {gate: ("w13", "gate"), up: ("w13", "up"), down: ("w2", "down")}

    def route(name: str) -> tuple[str, ShardId] | None:
        match = _EXPERT_NAME.match(name)
        if match is None or match["proj"] not in slots:
            return None
        layer = match["layer"]
        if module is not None and layer.endswith(f".{module[0]}"):
            layer = layer[: -len(module[0])] + module[1]
        stacked, slot = slots[match["proj"]]
        return f"{layer}.experts.{stacked}_{match['suffix']}", (int(match["expert"]), slot)

    return route
