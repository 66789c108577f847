"""The torch grouped LoRA ops equal a per-token float64 loop over each token's adapter."""

from __future__ import annotations

import pytest
import torch
from hitchllm_lora.ops import lora_expand, lora_shrink


def pool(num_slots: int, max_rank: int, ranks: list[int], rows: int, cols: int,
         b_layout: bool) -> torch.Tensor:
    """A stacked pool with zeros past each slot's rank (``[S, R, cols]`` for A, ``[S, rows,
    R]`` for B)."""
    g = torch.Generator().manual_seed(rows * 31 + cols)
    shape = (num_slots, rows, max_rank) if b_layout else (num_slots, max_rank, cols)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    for s, r in enumerate(ranks):
        if b_layout:
            w[s, :, r:] = 0
        else:
            w[s, r:] = 0
    return w


def reference(x, a, b, token_slot, scaling, out, offset):
    out = out.double().clone()
    for t, s in enumerate(token_slot.tolist()):
        if s >= 0:
            y = scaling[s].double() * (x[t].double() @ a[s].double().T)
            out[t, offset:offset + b.shape[1]] += y @ b[s].double().T
    return out


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_shrink_then_expand_matches_per_token_loop(dtype, tol):
    num_tokens, hidden, width, max_rank, ranks = 37, 48, 24, 8, [8, 3, 1, 5]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    a = pool(4, max_rank, ranks, 0, hidden, b_layout=False).to(dtype)
    b = pool(4, max_rank, ranks, width, 0, b_layout=True).to(dtype)
    token_slot = torch.randint(-1, 4, (num_tokens,), generator=g, dtype=torch.int32)
    token_slot[:3] = -1  # some base-model rows for sure
    token_slot[3:6] = 2
    scaling = torch.tensor([0.5, 2.0, 1.25, 4.0])
    out = torch.randn(num_tokens, 3 * width, generator=g).to(dtype)
    expected = reference(x, a, b, token_slot, scaling, out, width)

    y = lora_shrink(x, a, token_slot, scaling)
    assert y.dtype == torch.float32 and y.shape == (num_tokens, max_rank)
    assert not y[token_slot < 0].any()
    before = out.clone()
    lora_expand(y, b, token_slot, out, out_offset=width)
    assert torch.equal(out[:, :width], before[:, :width])  # outside the slice: untouched
    assert torch.equal(out[:, 2 * width:], before[:, 2 * width:])
    assert torch.equal(out[token_slot < 0], before[token_slot < 0])  # base rows: untouched
    scale = expected.abs().max().item()
    assert (out.double() - expected).abs().max().item() <= tol * scale


def test_int64_slots_and_a_single_token():
    x = torch.randn(1, 16)
    a = torch.randn(2, 4, 16)
    b = torch.randn(2, 8, 4)
    out = torch.zeros(1, 8)
    slot = torch.tensor([1], dtype=torch.int64)
    scaling = torch.tensor([1.0, 3.0])
    lora_expand(lora_shrink(x, a, slot, scaling), b, slot, out)
    torch.testing.assert_close(out, 3.0 * (x @ a[1].T) @ b[1].T, rtol=1e-5, atol=1e-5)
