"""Model building blocks that plugins hold on to: linear layers with a pluggable linear method
(quantization) and tensor-parallel weight loaders, the vocabulary-parallel embedding and LM
head, and the mixture-of-experts layer with its routing functions."""

from hitchllm.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from hitchllm.layers.loading import load_named_weights, process_weights_after_loading
from hitchllm.layers.method import (
    CPU_BF16_KERNEL,
    CPU_F32_KERNEL,
    LinearMethod,
    QuantizationMethod,
    UnquantizedLinearMethod,
    WeightLoader,
    default_weight_loader,
    set_weight_attrs,
)
from hitchllm.layers.moe import (
    FusedMoE,
    MoEMethod,
    UnquantizedMoEMethod,
    expert_route,
    grouped_topk,
    softmax_topk,
)
from hitchllm.layers.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "CPU_BF16_KERNEL",
    "CPU_F32_KERNEL",
    "ColumnParallelLinear",
    "FusedMoE",
    "LinearBase",
    "LinearMethod",
    "MergedColumnParallelLinear",
    "MoEMethod",
    "ParallelLMHead",
    "QKVParallelLinear",
    "QuantizationMethod",
    "ReplicatedLinear",
    "RowParallelLinear",
    "UnquantizedLinearMethod",
    "UnquantizedMoEMethod",
    "VocabParallelEmbedding",
    "WeightLoader",
    "default_weight_loader",
    "expert_route",
    "grouped_topk",
    "load_named_weights",
    "process_weights_after_loading",
    "set_weight_attrs",
    "softmax_topk",
]
