"""Rotary embedding, with and without Qwen3's q/k RMSNorm, as one Triton kernel
(``hitchllm.models.rotary_kernel``): against ``fused``'s PyTorch arithmetic on the CPU in
Triton's interpreter (float32 and float16, odd head counts and sizes, strided views of a
packed qkv tensor) and in bfloat16 at Qwen3-0.6B's sizes on the GPU."""

from __future__ import annotations

import pytest
import torch

from hitchllm.models import fused, rotary_kernel
from hitchllm.models.rope import RotaryEmbedding


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
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
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
        else:  # every rounding where PyTorch rounds
            assert torch.equal(g, w)


def test_no_tokens_and_one_token():
    positions, q, k, q_w, k_w, cos, sin = _inputs(1, 4, 2, 16, torch.float32)
    got = rotary_kernel.qk_norm_rotary(positions, q, k, q_w, k_w, 1e-6, cos, sin)
    want = _reference(positions, q, k, q_w, k_w, cos, sin, True)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    empty = rotary_kernel.rotary(positions[:0], q[:0], k[:0], cos, sin)
    assert [t.shape for t in empty] == [(0, 4, 16), (0, 2, 16)]


def test_declines_what_it_does_not_compute():
    """None sends the call to the compiled function: tables not float32, a head dimension
    that is not contiguous, norm weights of another dtype than the activations."""
    positions, q, k, q_w, k_w, cos, sin = _inputs(3, 4, 2, 16, torch.bfloat16)
    assert rotary_kernel.rotary(positions, q, k, cos.double(), sin.double()) is None
    assert rotary_kernel.rotary(positions, q.transpose(1, 2), k, cos, sin) is None
    assert rotary_kernel.qk_norm_rotary(positions, q, k, q_w.float(), k_w.float(), 1e-6, cos,
                                        sin) is None
    assert rotary_kernel.qk_norm_rotary(positions, q, k, q_w, k_w, 1e-6, cos, sin) is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_gpu_bf16_qwen3_sizes(tokens):
    """What the engine runs on CUDA (``fused`` routes both functions to the kernel) against
    float64: no further from it than the same bf16 arithmetic op by op in PyTorch, and equal to
    that on all but a few values (float32 sums of squares in another order can round a
    normalized value the other way). Rotary alone is PyTorch's, exactly."""
    positions, q, k, q_w, k_w, cos, sin = _inputs(tokens, 16, 8, 128, torch.bfloat16, "cuda")
    got = fused.qk_norm_rotary(positions, q, k, q_w, k_w, 1e-6, cos, sin)
    want = _reference(positions, q, k, q_w, k_w, cos, sin, True)
    exact = _reference(positions, q.double(), k.double(), q_w.double(), k_w.double(),
                       cos.double(), sin.double(), True)
    for g, w, e in zip(got, want, exact):
        ours, torchs = (g.double() - e).abs().max(), (w.double() - e).abs().max()
        assert ours <= 1.25 * torchs, (ours, torchs)
        assert (g != w).float().mean() < 1e-3
    got = fused.rotary(positions, q, k, cos, sin)
    want = _reference(positions, q, k, q_w, k_w, cos, sin, False)
    assert all(torch.equal(g, w) for g, w in zip(got, want))


_PTX_CHECK = """
import re, sys
import torch
from hitchllm.attention.triton_support import compile_for_gpu
from hitchllm.models import rotary_kernel as rk

kernel = rk._norm_rotary_kernel
for dtype in ("bf16", "fp16"):
    types = {n: "*" + dtype for n in kernel.arg_names if n.endswith("_ptr")}
    types |= {"pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "eps": "fp32"}
    constexprs = {"Q_HEADS": 16, "Q_PAD": 16, "K_HEADS": 8, "K_PAD": 8, "HALF": 64,
                  "HALF_PAD": 64, "NORM": True}
    compiled = compile_for_gpu(kernel, constexprs, types, set(types), 4, 1, 90)
    ptx = compiled.asm["ptx"]
    print(dtype, len(re.findall(r"and\\.b32\\s+%r\\d+, %r\\d+, -65536;", ptx)),
          len(re.findall(r"cvt\\.rn\\.f16", ptx)))
"""


def test_roundings_survive_compilation_for_an_h100(tmp_path):
    """Compiled for sm_90 (on the CPU), the bf16 kernel keeps its roundings: Triton folded
    ``x.to(bf16).to(float32)`` away, so they are integer masks, one per rounding site and
    element pair at least; fp16 compiles with its conversions."""
    import os
    import subprocess
    import sys

    env = os.environ | {"TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", _PTX_CHECK], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    counts = {line.split()[0]: [int(n) for n in line.split()[1:]]
              for line in result.stdout.splitlines()}
    # 6 rounding sites per head element pair (normalized, weighted, four products, plus the
    # stores' and the tables'): well over 12 masks in any layout.
    assert counts["bf16"][0] >= 12
    assert counts["fp16"][1] >= 1
