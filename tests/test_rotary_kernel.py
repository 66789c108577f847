"""Rotary embedding, with and without Qwen3's q/k RMSNorm, as one Triton kernel
(``hitchllm.models.rotary_kernel``): against ``fused``'s PyTorch arithmetic on the CPU in
Triton's interpreter (float32 and float16, odd head counts and sizes, strided views of a
packed qkv tensor) and in bfloat16 at Qwen3-0.6B's sizes on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from hitchllm.models import fused, rotary_kernel
from hitchllm.models.rope import RotaryEmbedding
from hitchllm.models.rounding import round_to


def _inputs(tokens, q_heads, kv_heads, head_dim, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(tokens, (q_heads + 2 * kv_heads) * head_dim, generator=g) * 3)
    qkv = qkv.to(dtype).to(device)
    q = qkv[:, : q_heads * head_dim].reshape(tokens, q_heads, head_dim)
    k = qkv[:, q_heads * head_dim: (q_heads + kv_heads) * head_dim].reshape(
        tokens, kv_heads, head_dim)
    rope = RotaryEmbedding(head_dim, 4096, 1e6, None).to(device)
    positions = torch.randint(0, 4096, (tokens,), generator=g).to(device)
    q_w = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
    k_w = (torch.rand(head_dim, generator=g) + 0.5).to(dtype).to(device)
    return positions, q, k, q_w, k_w, rope.cos, rope.sin


def _reference(positions, q, k, q_w, k_w, cos, sin, norm):
    if norm:
        q, k = fused._normalize(q, q_w, 1e-6), fused._normalize(k, k_w, 1e-6)
    return fused._apply_rotary(positions, q, k, cos, sin)


@pytest.mark.parametrize("norm", [True, False], ids=["qk_norm_rotary", "rotary"])
@pytest.mark.parametrize("shape", [(6, 3, 24), (4, 2, 16), (8, 1, 32)],
                         ids=["odd-heads-and-half", "gqa2", "mqa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_pytorch(norm, shape, dtype):
    positions, q, k, q_w, k_w, cos, sin = _inputs(5, *shape, dtype)
    if norm:
        got = rotary_kernel.qk_norm_rotary(positions, q, k, q_w, k_w, 1e-6, cos, sin)
    else:
        got = rotary_kernel.rotary(positions, q, k, cos, sin)
    want = _reference(positions, q, k, q_w, k_w, cos, sin, norm)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and g.is_contiguous()
        if dtype == torch.float32:  # sums of squares in another order
            torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)
        else:  # every rounding where PyTorch rounds (the masks of _round)
            assert torch.equal(g, w)


def test_no_tokens_and_one_token():
    positions, q, k, q_w, k_w, cos, sin = _inputs(1, 4, 2, 16, torch.float32)
    got = rotary_kernel.qk_norm_rotary(positions, q, k, q_w, k_w, 1e-6, cos, sin)
    want = _reference(positions, q, k, q_w, k_w, cos, sin, True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    empty = rotary_kernel.rotary(positions[:0], q[:0], k[:0], cos, sin)
    assert [t.shape for t in empty] == [(0, 4, 16), (0, 2, 16)]


def test_declines_what_it_does_not_compute():
    """None sends the call to the compiled function: float16 (whose products sm_90 fuses
    past their roundings), tables not float32, a head dimension that is not contiguous,
    positions that are not one per token, norm weights of another dtype or size, autograd."""
    positions, q, k, q_w, k_w, cos, sin = _inputs(3, 4, 2, 16, torch.bfloat16)
    norm = rotary_kernel.qk_norm_rotary
    assert rotary_kernel.rotary(positions, q.half(), k.half(), cos, sin) is None
    assert rotary_kernel.rotary(positions, q, k, cos.double(), sin.double()) is None
    assert rotary_kernel.rotary(positions, q.transpose(1, 2), k, cos, sin) is None
    assert rotary_kernel.rotary(positions[:2], q, k, cos, sin) is None
    assert rotary_kernel.rotary(positions.repeat(2)[::2], q, k, cos, sin) is None
    assert norm(positions, q, k, q_w.float(), k_w.float(), 1e-6, cos, sin) is None
    assert norm(positions, q, k, q_w[:8], k_w[:8], 1e-6, cos[:, :4], sin[:, :4]) is None
    assert norm(positions, q, k, q_w[:8].repeat(2), k_w, 1e-6, cos, sin) is not None
    assert norm(positions, q, k, q_w.repeat(2), k_w, 1e-6, cos, sin) is None
    leaf = q_w.clone().requires_grad_()
    assert norm(positions, q, k, leaf, k_w, 1e-6, cos, sin) is None
    with torch.no_grad():
        assert norm(positions, q, k, leaf, k_w, 1e-6, cos, sin) is not None


@triton.jit
def _round_bits(x_ptr, out_ptr, N: tl.constexpr, PTX: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, round_to(tl.load(x_ptr + i), tl.bfloat16, PTX))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                        reason="needs a CUDA device")])])
def test_bf16_rounding_keeps_nans_and_rounds_to_nearest_even(device):
    """``round_to`` against PyTorch's conversion, with NaNs whose payloads integer masks would
    carry into the sign bit or round to infinity (an NVIDIA GPU's canonical NaN is
    0x7FFFFFFF): the interpreter's integer masks on the CPU, the PTX conversions on a GPU."""
    bits = torch.tensor([0x7FFFFFFF, -1, 0x7F800001, 0x7F800000, 0x3F808000, 0x3F818000,
                         0x3F80C000, 0x00000001, 0x7F7FFFFF, 0x3F800000, 0xBF80FFFF - 2**32,
                         0x3F7F8000, 0x3F7F7FFF, 0x7F7F8000, 0x00018000, 0x80000000 - 2**32],
                        dtype=torch.int32)
    x = bits.view(torch.float32).to(device)
    out = torch.empty_like(x)
    _round_bits[(1,)](x, out, N=len(x), PTX=device == "cuda")
    want = x.to(torch.bfloat16).float()
    assert out[:3].isnan().all()
    torch.testing.assert_close(out[3:], want[3:], atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_gpu_bf16_qwen3_sizes(tokens):
    """What the engine runs on CUDA (``fused`` routes both functions to the kernel) against
    float64: no further from it than the same bf16 arithmetic op by op in PyTorch, and equal to
    that on all but a few values (float32 sums of squares in another order can round a
    normalized value the other way). Rotary alone is PyTorch's, exactly."""
    positions, q, k, q_w, k_w, cos, sin = _inputs(tokens, 16, 8, 128, torch.bfloat16, "cuda")
    q[0, 0, 5] = float("nan")  # that head all NaN, as PyTorch makes it
    q[0, 1, 7] = float("inf")
    got = fused.qk_norm_rotary(positions, q, k, q_w, k_w, 1e-6, cos, sin)
    want = _reference(positions, q, k, q_w, k_w, cos, sin, True)
    exact = _reference(positions, q.double(), k.double(), q_w.double(), k_w.double(),
                       cos.double(), sin.double(), True)
    for g, w, e in zip(got, want, exact):
        assert torch.equal(g.isnan(), w.isnan())
        finite = w.isfinite() & e.isfinite()
        ours = (g.double() - e)[finite].abs().max()
        torchs = (w.double() - e)[finite].abs().max()
        assert ours <= 1.25 * torchs, (ours, torchs)
        assert (g[finite] != w[finite]).float().mean() < 1e-3
    got = fused.rotary(positions, q, k, cos, sin)
    want = _reference(positions, q, k, q_w, k_w, cos, sin, False)
    for g, w in zip(got, want):  # NaN where PyTorch has NaN, every other value equal
        torch.testing.assert_close(g, w, atol=0, rtol=0, equal_nan=True)
