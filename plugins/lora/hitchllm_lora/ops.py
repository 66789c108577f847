"""Grouped LoRA matmuls over a packed batch, in plain torch (the CPU path and reference).

Every token carries the slot of its request's adapter in a stacked pool (``token_slot``; -1
for the base model). ``lora_shrink`` projects tokens down to the rank (``x @ A[slot].T``,
scaled), ``lora_expand`` back up and adds into a column range of the layer's output
(``y @ B[slot].T``), so one call serves every adapter of the batch.

Both are written for CUDA-graph capture as much as for the CPU: no host synchronization and
no shape that depends on the slot values. The shrink multiplies by every slot's ``A`` at once
(``S * R`` columns: the pool is ``[S, R, H]``, so that is one matmul with no copy) and picks
each token's slot with a gather; the expand runs one matmul per slot on the tokens masked to
it. Rows of ``A`` and columns of ``B`` past an adapter's rank are zero in the pool.
"""

from __future__ import annotations

import torch


def lora_shrink(
    x: torch.Tensor, lora_a: torch.Tensor, token_slot: torch.Tensor, scaling: torch.Tensor
) -> torch.Tensor:
    """``y[t] = scaling[s] * (x[t] @ lora_a[s].T)`` with ``s = token_slot[t]``; 0 where
    ``s == -1``.

    ``x`` ``[T, H_in]``; ``lora_a`` ``[S, R, H_in]``; ``token_slot`` ``[T]`` (int);
    ``scaling`` ``[S]`` float32. Returns ``[T, R]`` float32.
    """
    num_tokens = x.shape[0]
    num_slots, rank, hidden = lora_a.shape
    every_slot = (x @ lora_a.reshape(num_slots * rank, hidden).T).view(num_tokens, num_slots,
                                                                        rank)
    slot = token_slot.long().clamp(min=0)
    y = every_slot.gather(1, slot.view(-1, 1, 1).expand(num_tokens, 1, rank)).squeeze(1)
    scale = torch.where(token_slot >= 0, scaling[slot], 0.0)
    return y.float() * scale.unsqueeze(1)


def lora_expand(
    y: torch.Tensor, lora_b: torch.Tensor, token_slot: torch.Tensor, out: torch.Tensor,
    out_offset: int = 0,
) -> None:
    """``out[t, out_offset:out_offset + N] += y[t] @ lora_b[s].T`` with ``s =
    token_slot[t]``, in place (accumulated in float32, cast to ``out.dtype``); nothing where
    ``s == -1``.

    ``y`` ``[T, R]``; ``lora_b`` ``[S, N, R]``; ``token_slot`` ``[T]`` (int).
    """
    num_slots, width, _ = lora_b.shape
    acc = torch.zeros(y.shape[0], width, dtype=torch.float32, device=y.device)
    y = y.float()
    for s in range(num_slots):
        masked = y * (token_slot == s).unsqueeze(1)
        acc.addmm_(masked, lora_b[s].T.float())
    target = out.narrow(1, out_offset, width)
    target.add_(acc.to(out.dtype))
