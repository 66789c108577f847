"""RMS normalization."""

from __future__ import annotations

import torch
from torch import nn

from hitchllm.models import fused, split_k


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, with the statistics computed in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused.rms_norm(x, self.weight, self.eps)

    def add_and_norm(
        self, x: torch.Tensor | split_k.SplitSum, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(self(x + residual), x + residual)`` in one pass (``x`` may be a projection's
        split sums, see ``hitchllm.models.split_k``)."""
        if isinstance(x, split_k.SplitSum):
            return split_k.add_rms_norm(x, residual, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)
