"""Model building blocks that plugins hold on to: linear layers with a pluggable linear method
(quantization) and tensor-parallel weight loaders, and the vocabulary-parallel embedding and
LM head."""

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
    LinearMethod,
    QuantizationMethod,
    UnquantizedLinearMethod,
    WeightLoader,
    default_weight_loader,
    set_weight_attrs,
)
from hitchllm.layers.vocab import ParallelLMHead, VocabParallelEmbedding

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "LinearMethod",
    "MergedColumnParallelLinear",
    "ParallelLMHead",
    "QKVParallelLinear",
    "QuantizationMethod",
    "ReplicatedLinear",
    "RowParallelLinear",
    "UnquantizedLinearMethod",
    "VocabParallelEmbedding",
    "WeightLoader",
    "default_weight_loader",
    "load_named_weights",
    "process_weights_after_loading",
    "set_weight_attrs",
]
