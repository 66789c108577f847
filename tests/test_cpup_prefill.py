"""Prefill on the CPU (issue 22, points 1 and 5): what changed on the prompt path.

- CPU_ATTN pads bfloat16 prompts with no cached prefix to a multiple of
  ``SDPA_LENGTH_MULTIPLE`` for SDPA: against the float64 reference on random paged caches
  (GQA and MHA, several lengths on and off the multiple, with and without a cached prefix,
  prompts mixed with decodes, stale non-finite values in the cache's unused slots), and against
  the unpadded path (TORCH's) within bf16 rounding.
"""

from __future__ import annotations

import pytest
import torch
from test_cpu_attention import run_cpu_attn

pytest.importorskip("hitchllm_attention_cpu")

from hitchllm.attention.torch_backend import TorchAttentionImpl
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


