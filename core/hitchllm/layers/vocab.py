"""The token embedding and the LM head, split over tensor-parallel ranks by vocabulary rows.

The vocabulary is cut into ``world_size`` partitions of ``ceil(vocab_size / world_size)`` rows;
rank ``r`` holds rows ``[r * n, min((r + 1) * n, vocab_size))``, and the last partition is
padded with zero rows up to ``n``. In a world of size 1 there is no padding: the embedding is
one ``F.embedding`` and the LM head one ``F.linear`` producing exactly ``vocab_size`` logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hitchllm import distributed
from hitchllm.layers.method import (
    LinearMethod,
    QuantizationMethod,
    ShardId,
    UnquantizedLinearMethod,
    copy_checked,
)


class _VocabParallel(nn.Module):
    """The vocabulary partition of this rank and the loader that fills it."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int,
        quant_config: QuantizationMethod | None, prefix: str,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.tp_rank = distributed.tp_rank()
        self.tp_size = distributed.tp_world_size()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        # Read by linear methods: the layer's full sizes.
        self.input_size, self.output_size = embedding_dim, num_embeddings
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = min(self.tp_rank * self.num_embeddings_per_partition, num_embeddings)
        self.vocab_end = min(self.vocab_start + self.num_embeddings_per_partition, num_embeddings)
        method = quant_config.get_linear_method(self, prefix) if quant_config else None
        self.linear_method: LinearMethod = method or UnquantizedLinearMethod()
        self.linear_method.create_weights(
            self, embedding_dim, [self.num_embeddings_per_partition], torch.get_default_dtype(),
            self.weight_loader,
        )

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None:
        """Copy this rank's vocabulary rows of ``loaded_weight``; padding rows become zero."""
        if shard_id is not None:
            raise ValueError(f"a vocabulary layer has no stacked slots, got {shard_id!r}")
        dim = getattr(param, "output_dim", None)
        if dim is None:
            copy_checked(param.data, loaded_weight)
            return
        if loaded_weight.shape[dim] != self.num_embeddings:
            raise ValueError(f"shape {tuple(loaded_weight.shape)} has "
                             f"{loaded_weight.shape[dim]} vocabulary rows, expected "
                             f"{self.num_embeddings}")
        rows = self.vocab_end - self.vocab_start
        if rows < param.shape[dim]:
            param.data.narrow(dim, rows, param.shape[dim] - rows).zero_()
        copy_checked(param.data.narrow(dim, 0, rows),
                     loaded_weight.narrow(dim, self.vocab_start, rows))


class VocabParallelEmbedding(_VocabParallel):
    """Token id -> embedding row. Each rank looks up the ids in its partition (zero for the
    others); the ranks' outputs sum (``distributed.all_reduce``) to the full embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, prefix: str = "") -> None:
        # Always unquantized: the lookup reads rows of a plain weight.
        super().__init__(num_embeddings, embedding_dim, None, prefix)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        inside = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local = torch.where(inside, input_ids - self.vocab_start, 0)
        out = F.embedding(local, self.weight) * inside.unsqueeze(-1).to(self.weight.dtype)
        return distributed.all_reduce(out)


class ParallelLMHead(_VocabParallel):
    """Hidden state -> logits over the vocabulary. Each rank computes its partition's logits;
    gathered (``distributed.all_gather``) and trimmed of padding they are the full logits.
    A quantization method may supply the linear method (asked with this layer's ``prefix``)
    unless the head is tied to the embedding."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *,
        quant_config: QuantizationMethod | None = None, prefix: str = "",
    ) -> None:
        super().__init__(num_embeddings, embedding_dim, quant_config, prefix)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (``tie_word_embeddings``); the head stays
        unquantized."""
        if not isinstance(self.linear_method, UnquantizedLinearMethod):
            raise ValueError("a quantized LM head cannot share the embedding's weight")
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.linear_method.apply(self, hidden)
        if self.tp_size > 1:
            logits = distributed.all_gather(logits, dim=-1)[..., : self.num_embeddings]
        return logits
