"""DeepSeek's feed-forward blocks: the dense gated MLP and the mixture-of-experts layer.

A MoE layer (``DeepseekMoE``) sums its routed experts (hitchllm's ``FusedMoE``) and its
``n_shared_experts`` shared experts (one gated MLP of ``n_shared_experts *
moe_intermediate_size``) that every token goes through. The router (``gate``) keeps its weight
and V3's ``e_score_correction_bias`` in float32 and computes the logits in float32, as
transformers does; ``DeepseekRouting.from_config`` reads how it picks experts:

- DeepSeek-V2, ``topk_method="greedy"``: softmax over all experts, the ``k`` best;
- DeepSeek-V2, ``"group_limited_greedy"``: softmax, the ``topk_group`` groups (of ``n_group``)
  with the best single score, then the ``k`` best in them;
- DeepSeek-V3 (``noaux_tc``): sigmoid; the choice adds ``e_score_correction_bias`` and keeps
  the ``topk_group`` groups with the best sum of two biased scores; the weights are the unbiased
  scores, divided by their sum when ``norm_topk_prob``.

Both scale the weights by ``routed_scaling_factor``; V2 never renormalizes (its
``norm_topk_prob`` is ignored, as in transformers). Missing fields take transformers'
defaults for the architecture.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from hitchllm import distributed
from hitchllm.config import ModelConfig
from hitchllm.layers import (
    FusedMoE,
    MergedColumnParallelLinear,
    QuantizationMethod,
    RowParallelLinear,
    grouped_topk,
)
from hitchllm.models import fused

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


class DeepseekMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the dense layers' feed-forward and the shared
    experts. ``reduce_results=False`` leaves this rank's partial output unsummed under tensor
    parallelism."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str,
                 quant_config: QuantizationMethod | None, prefix: str,
                 reduce_results: bool = True) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"hidden_act {hidden_act!r} is not supported (only silu)")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size,
                                           reduce_results=reduce_results,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_and_mul(self.gate_up_proj(x)))


@dataclass(frozen=True)
class DeepseekRouting:
    """How a DeepSeek router turns logits into each token's experts (``grouped_topk``'s
    arguments)."""

    num_experts: int
    top_k: int
    num_expert_group: int | None
    topk_group: int | None
    scoring: Literal["softmax", "sigmoid"]
    correction_bias: bool
    renormalize: bool
    routed_scaling_factor: float

    def __post_init__(self) -> None:
        groups = self.num_expert_group
        if groups is None or groups <= 1:
            return
        if self.num_experts % groups:
            raise ValueError(f"n_routed_experts ({self.num_experts}) does not split into "
                             f"n_group={groups} equal groups; use an n_group that divides it")
        if self.topk_group is None or not 1 <= self.topk_group <= groups:
            raise ValueError(f"topk_group is {self.topk_group}; it must be between 1 and "
                             f"n_group ({groups})")

    @classmethod
    def from_config(cls, config: ModelConfig) -> DeepseekRouting:
        """V2's ``topk_method`` (greedy / group_limited_greedy) or V3's noaux_tc, with the
        defaults of transformers' config classes for absent fields."""
        hf: dict[str, Any] = config.hf_config
        num_experts = hf.get("n_routed_experts") or 0
        top_k = hf.get("num_experts_per_tok") or 0
        if num_experts < 1 or not 1 <= top_k <= num_experts:
            raise ValueError(f"{config.architecture}: num_experts_per_tok ({top_k}) must be "
                             f"between 1 and n_routed_experts ({num_experts})")
        if config.architecture == "DeepseekV3ForCausalLM":
            return cls(num_experts, top_k, hf.get("n_group", 8), hf.get("topk_group", 4),
                       "sigmoid", correction_bias=True,
                       renormalize=bool(hf.get("norm_topk_prob", True)),
                       routed_scaling_factor=float(hf.get("routed_scaling_factor", 2.5)))
        method = hf.get("topk_method", "greedy")
        if method not in V2_TOPK_METHODS:
            raise ValueError(f"{config.architecture}: topk_method {method!r} is not supported; "
                             f"DeepSeek-V2 routes with one of {V2_TOPK_METHODS}")
        grouped = method == "group_limited_greedy"
        if grouped and not (hf.get("n_group") and hf.get("topk_group")):
            raise ValueError(f"{config.architecture}: topk_method 'group_limited_greedy' needs "
                             f"n_group and topk_group in config.json (got {hf.get('n_group')}, "
                             f"{hf.get('topk_group')})")
        return cls(num_experts, top_k, hf.get("n_group") if grouped else None,
                   hf.get("topk_group") if grouped else None, "softmax",
                   correction_bias=False, renormalize=False,
                   routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))


class DeepseekRouter(nn.Module):
    """The ``gate``: float32 ``weight [experts, hidden]`` (and ``e_score_correction_bias
    [experts]`` for V3); ``forward(x)`` gives ``(topk_weights, topk_ids)``."""

    def __init__(self, hidden_size: int, routing: DeepseekRouting) -> None:
        super().__init__()
        self.routing = routing
        self.weight = nn.Parameter(torch.empty(routing.num_experts, hidden_size,
                                               dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(routing.num_experts, dtype=torch.float32),
                         requires_grad=False) if routing.correction_bias else None)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.routing
        logits = F.linear(x.float(), self.weight)
        return grouped_topk(logits, r.top_k, r.num_expert_group, r.topk_group, r.scoring,
                            self.e_score_correction_bias, r.renormalize,
                            r.routed_scaling_factor)


class DeepseekMoE(nn.Module):
    """Routed experts plus shared experts, ``[tokens, hidden] -> [tokens, hidden]``; under
    tensor parallelism both partial sums are added before the one all-reduce."""

    def __init__(self, config: ModelConfig, quant_config: QuantizationMethod | None,
                 prefix: str) -> None:
        super().__init__()
        hf = config.hf_config
        routing = DeepseekRouting.from_config(config)
        inter = hf["moe_intermediate_size"]
        self.gate = DeepseekRouter(config.hidden_size, routing)
        self.experts = FusedMoE(routing.num_experts, config.hidden_size, inter,
                                activation=config.hidden_act, reduce_results=False,
                                quant_config=quant_config, prefix=f"{prefix}.experts")
        shared = hf.get("n_shared_experts") or 0
        self.shared_experts = (
            DeepseekMLP(config.hidden_size, inter * shared, config.hidden_act, quant_config,
                        f"{prefix}.shared_experts", reduce_results=False)
            if shared else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if distributed.tp_world_size() > 1:
            out = distributed.all_reduce(out)
        return out
