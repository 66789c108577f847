"""Rotary embedding computed half by half (hitchllm.models.fused._rotate) gives exactly the
values of transformers' rotate-half reference, in float32 and in the 16-bit dtypes, so greedy
tokens do not move when the CPU path drops the rotated copy and the doubled tables."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hitchllm.models import fused
from hitchllm.models.rope import RotaryEmbedding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("head_dim", [32, 64])
def test_rotary_is_bitwise_transformers(dtype, head_dim):
    torch.manual_seed(0)
    rope = RotaryEmbedding(head_dim, max_position=512, theta=10000.0, scaling=None)
    positions = torch.randint(0, 512, (37,))
    q = (torch.randn(37, 8, head_dim) * 3).to(dtype)
    k = (torch.randn(37, 2, head_dim) * 3).to(dtype)
    fused.set_fusion(False)
    try:
        got_q, got_k = rope(positions, q, k)
    finally:
        fused.set_fusion(True)
    # transformers: cos/sin [T, d] (the half tables doubled) cast to the model dtype, heads
    # on dimension 1 of [batch, heads, T, d].
    cos = torch.cat((rope.cos, rope.cos), dim=-1)[positions].to(dtype)[None]
    sin = torch.cat((rope.sin, rope.sin), dim=-1)[positions].to(dtype)[None]
    want_q, want_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                          cos, sin)
    assert torch.equal(got_q, want_q[0].transpose(0, 1))
    assert torch.equal(got_k, want_k[0].transpose(0, 1))
    assert not torch.equal(got_q, q)  # the rotation did something
