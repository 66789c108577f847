"""Prefill on the CPU (issue 22, points 1 and 5): what changed on the prompt path.

- CPU_ATTN pads bfloat16 prompts with no cached prefix to a multiple of
  ``SDPA_LENGTH_MULTIPLE`` for SDPA: against the float64 reference on random paged caches
  (GQA and MHA, several lengths on and off the multiple, with and without a cached prefix,
  prompts mixed with decodes, stale non-finite values in the cache's unused slots), and against
  the unpadded path (TORCH's) within bf16 rounding.
- bfloat16 linears pad their rows to a bounded set of sizes (``padded_rows``): the same bits
  as ``F.linear`` at sizes on and off the buckets.
- ``silu_and_mul``'s in-place product: the same bits as the out-of-place one.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_cpu_attention import run_cpu_attn
from test_cpuk_bf16_linear import _layer, needs_bf16

pytest.importorskip("hitchllm_attention_cpu")

from hitchllm.attention.torch_backend import TorchAttentionImpl
from hitchllm.layers.method import padded_rows
from hitchllm.models import fused
from hitchllm_attention_cpu.backend import SDPA_LENGTH_MULTIPLE, CpuAttentionImpl

# bf16 K/V and queries: the reference reads the same rounded values, so what differs is the
# products' rounding and the output's (one bf16 ulp at |out| ~ 1 is 8e-3).
BF16_TOL = {"atol": 2e-2, "rtol": 1e-2}


@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("heads", [(6, 2), (4, 4)])
@pytest.mark.parametrize("lens", [
    ([0], [37]),  # one prompt off the multiple
    ([0, 0, 0], [16, 101, 50]),  # on and off the multiple, one step
    ([0, 5, 0, 12], [33, 20, 17, 1]),  # with a cached prefix (masked path) and a decode
])
def test_padded_prompt_matches_float64_reference(dtype, heads, lens):
    context_lens, query_lens = lens
    out, ref, meta = run_cpu_attn(context_lens, query_lens, *heads, head_size=32,
                                  block_size=16, dtype=dtype, seed=len(query_lens))
    assert out.dtype == dtype
    assert any(p.context_len == 0 and p.query_len % SDPA_LENGTH_MULTIPLE
               for p in meta.prompts)  # the padded path ran
    torch.testing.assert_close(out.double(), ref, **BF16_TOL)


@pytest.mark.parametrize("block_size", [4, 16, 32])
def test_padded_prompt_with_block_sizes_around_the_multiple(block_size):
    out, ref, _ = run_cpu_attn([0, 0], [45, 7 * block_size + 3], 6, 2, head_size=64,
                               block_size=block_size, dtype=torch.bfloat16, seed=block_size)
    torch.testing.assert_close(out.double(), ref, **BF16_TOL)


def _attend_both(q_len: int, poison: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One bf16 prompt of ``q_len`` tokens through CPU_ATTN's padded path and TORCH's."""
    from hitchllm.attention import AttentionSpec

    torch.manual_seed(q_len)
    heads, kv_heads, d, bs = 6, 2, 32, 16
    spec = AttentionSpec.for_device(torch.device("cpu"), dtype=torch.bfloat16,
                                    kv_cache_dtype=torch.bfloat16, head_size=d,
                                    num_heads=heads, num_kv_heads=kv_heads, block_size=bs)
    blocks = -(-q_len // bs)
    cache = torch.randn(2, kv_heads, blocks + 3, bs, d).bfloat16()
    if poison:  # the slots past the prompt hold stale values, here not even finite
        cache.view(2, kv_heads, -1, d)[:, :, q_len:] = float("inf")
    table = torch.randperm(blocks + 2, dtype=torch.int32)[:blocks]
    if poison:
        for b in table.tolist():  # keep the prompt's own rows finite, the rest of the block inf
            cache[:, :, b] = torch.randn(2, kv_heads, bs, d).bfloat16()
        last = int(table[-1])
        cache[:, :, last, q_len - (blocks - 1) * bs:] = float("inf")
    q = torch.randn(q_len, heads, d).bfloat16()
    args = (heads, d, d**-0.5, kv_heads, spec)
    key_cache, value_cache = cache.unbind(0)
    cpu = CpuAttentionImpl(*args).attend_request(q, key_cache, value_cache, table, 0)
    ref = TorchAttentionImpl(*args).attend_request(q, key_cache, value_cache, table, 0)
    return cpu, ref


@pytest.mark.parametrize("q_len", [17, 100, 501])
def test_padded_prompt_tracks_the_unpadded_path(q_len):
    cpu, ref = _attend_both(q_len, poison=False)
    assert cpu.shape == ref.shape and cpu.dtype == ref.dtype
    torch.testing.assert_close(cpu.float(), ref.float(), **BF16_TOL)


def test_padding_never_reads_stale_cache_rows():
    cpu, _ = _attend_both(37, poison=True)
    assert torch.isfinite(cpu).all()


def test_padded_rows_are_bounded_and_close():
    assert [padded_rows(n) for n in (1, 17, 64)] == [1, 17, 64]
    sizes = {padded_rows(n) for n in range(1, 8193)}
    assert len(sizes) <= 64 + 16 * 7  # 16 per power of two above 64
    for n in range(65, 8193):
        p = padded_rows(n)
        assert n <= p <= n * 17 / 16


@needs_bf16
@pytest.mark.parametrize("tokens", [65, 101, 257, 1001, 2049])
def test_bucketed_bf16_linear_matches_f_linear(tokens):
    torch.manual_seed(tokens)
    layer, method = _layer(320, 192)
    x = torch.randn(tokens, 192).bfloat16()
    assert padded_rows(tokens) > tokens  # the padded path runs
    with torch.inference_mode():
        got = method.apply(layer, x)
        got3 = method.apply(layer, x.view(1, tokens, 192))
    want = F.linear(x, layer.weight)
    assert got.shape == want.shape and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(got3[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_in_place_is_bit_identical(dtype):
    gate_up = torch.randn(300, 2 * 96).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    with torch.inference_mode():
        got = fused.silu_and_mul(gate_up)
    assert torch.equal(got, F.silu(gate) * up)
    with torch.enable_grad():  # the out-of-place product where autograd may need it
        x = gate_up.float().requires_grad_()
        fused.silu_and_mul(x).sum().backward()
        assert x.grad is not None
