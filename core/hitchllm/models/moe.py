"""The mixture-of-experts members of the Llama family: Qwen3-MoE and Mixtral.

Their attention is the family's (Qwen3-MoE has Qwen3's q/k norm; Mixtral is Mistral's, sliding
window when the config sets one); the MLP of a sparse layer is a ``SparseMoeBlock``: a router
(``gate``, a plain linear layer, never quantized) whose softmax top-k picks each token's
experts, and a ``FusedMoE`` that sums them. Qwen3-MoE keeps a dense MLP in the layers
``mlp_only_layers`` names and in those off its ``decoder_sparse_step``.

Checkpoints store one tensor per expert and projection; ``expert_route`` places them in the
stacked expert weights (Mixtral's ``block_sparse_moe`` is our ``mlp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from hitchllm.config import ModelConfig
from hitchllm.layers import QuantizationMethod, ReplicatedLinear
from hitchllm.layers.loading import Route
from hitchllm.layers.moe import FusedMoE, expert_route
from hitchllm.layers.moe_routing import softmax_topk
from hitchllm.models.llama import LlamaForCausalLM, LlamaMLP, MLPFactory


@dataclass(frozen=True)
class ExpertsConfig:
    """The mixture-of-experts part of a config."""

    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ValueError(f"the config has {self.num_experts} experts; a mixture-of-experts "
                             "model needs at least one (num_experts / num_local_experts)")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be between 1 and the "
                             f"number of experts ({self.num_experts})")


class SparseMoeBlock(nn.Module):
    """Softmax top-k routing over ``experts.num_experts`` gated MLPs."""

    def __init__(
        self, config: ModelConfig, experts: ExpertsConfig,
        quant_config: QuantizationMethod | None, prefix: str,
    ) -> None:
        super().__init__()
        self.top_k = experts.top_k
        self.renormalize = experts.renormalize
        self.gate = ReplicatedLinear(config.hidden_size, experts.num_experts,
                                     prefix=f"{prefix}.gate")
        self.experts = FusedMoE(experts.num_experts, config.hidden_size,
                                experts.intermediate_size, activation=config.hidden_act,
                                quant_config=quant_config, prefix=f"{prefix}.experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, self.renormalize)
        return self.experts(x, weights, ids)


def qwen3_moe_experts(config: ModelConfig) -> ExpertsConfig:
    hf = config.hf_config
    return ExpertsConfig(
        # transformers 5 writes num_local_experts; Qwen's checkpoints num_experts.
        num_experts=hf.get("num_experts") or hf.get("num_local_experts") or 0,
        top_k=hf["num_experts_per_tok"],
        intermediate_size=hf["moe_intermediate_size"],
        renormalize=bool(hf.get("norm_topk_prob", False)),
    )


def qwen3_moe_mlp(
    config: ModelConfig, layer_index: int, quant_config: QuantizationMethod | None, prefix: str
) -> nn.Module:
    """A sparse block unless the config has no experts, ``mlp_only_layers`` lists the layer
    or it is off the ``decoder_sparse_step`` (transformers' rule)."""
    hf = config.hf_config
    has_experts = bool(hf.get("num_experts") or hf.get("num_local_experts"))
    step = hf.get("decoder_sparse_step", 1)
    if (has_experts and layer_index not in (hf.get("mlp_only_layers") or [])
            and (layer_index + 1) % step == 0):
        return SparseMoeBlock(config, qwen3_moe_experts(config), quant_config, prefix)
    return LlamaMLP(config, quant_config, prefix)


def mixtral_mlp(
    config: ModelConfig, layer_index: int, quant_config: QuantizationMethod | None, prefix: str
) -> nn.Module:
    """Every Mixtral layer is sparse; the experts' size is ``intermediate_size``."""
    hf = config.hf_config
    experts = ExpertsConfig(num_experts=hf.get("num_local_experts", 0),
                            top_k=hf["num_experts_per_tok"],
                            intermediate_size=config.intermediate_size, renormalize=True)
    return SparseMoeBlock(config, experts, quant_config, prefix)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE: Qwen3's attention, sparse MLP blocks (dense where the config says)."""

    MAKE_MLP: ClassVar[MLPFactory] = staticmethod(qwen3_moe_mlp)
    ROUTE: ClassVar[Route | None] = staticmethod(expert_route())


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral: Mistral's attention, every MLP a sparse block (``block_sparse_moe``)."""

    MAKE_MLP: ClassVar[MLPFactory] = staticmethod(mixtral_mlp)
    ROUTE: ClassVar[Route | None] = staticmethod(
        expert_route("w1", "w3", "w2", module=("block_sparse_moe", "mlp")))

    def rename_weight(self, name: str) -> str | None:
        if ".block_sparse_moe.gate." in name:
            return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
        return super().rename_weight(name)
