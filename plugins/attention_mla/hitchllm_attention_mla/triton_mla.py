"""TRITON_MLA: a Triton paged MLA decode kernel (split-KV), with TORCH_MLA's prefill path.

Decode runs in the absorbed form: the query's no-rope part is folded through ``W_UK`` into
latent space on the host side of the kernel (one batched matmul), the kernel attends over the
paged latent cache reading each token's latent once for a block of heads, and ``W_UV`` maps
the latent output back to per-head values. Long contexts are split over several programs per
request ("split-KV"); each writes its partial output with its running maximum and sum, and
the partials are merged afterwards. Requests with several new tokens (prompts, chunks) run
TORCH_MLA's expanded path (SDPA).

The cache layout is TORCH_MLA's: ``[num_blocks + 1, block_size, kv_lora_rank + rope]``.
"""

from __future__ import annotations

import importlib.util
from typing import ClassVar

import torch

from hitchllm.attention import AttentionImpl, AttentionSpec
from hitchllm.attention.torch_backend import BatchedRequests
from hitchllm.attention.triton_support import triton_device_reasons
from hitchllm_attention_mla.torch_mla import TorchMLABackend, TorchMLAImpl, mla_reasons

#: Tokens one program reads per iteration, and the fewest programs a step should launch
#: before long contexts are split further.
BLOCK_N = 16
TARGET_PROGRAMS = 128


def _next_pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def mla_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, kv_lora_rank: int, max_seq_len: int,
               num_splits: int | None = None) -> torch.Tensor:
    """Absorbed MLA decode: ``q`` [N, heads, latent] (``W_UK``-absorbed no-rope part, then
    the rope part) of N one-token requests over their ``seq_lens`` cached latents
    (``kv_cache`` [blocks, block_size, latent], ``block_table`` [N, cols]). Returns the
    latent-space output [N, heads, kv_lora_rank] in float32: ``softmax(scale * q . latent)``
    weighted sum of the latents' first ``kv_lora_rank`` values."""
    from hitchllm_attention_mla.triton_mla_kernel import mla_decode_partials

    n, heads, width = q.shape
    # 16 heads per program: its output block (16 x kv_lora_rank float32, 32 KiB at V3's 512)
    # stays in registers; the other head blocks re-read the same latents, mostly from L2.
    block_h = 16
    head_blocks = -(-heads // block_h)
    if num_splits is None:
        wanted = max(1, TARGET_PROGRAMS // max(1, n * head_blocks))
        num_splits = max(1, min(wanted, -(-max_seq_len // BLOCK_N)))
    tokens_per_split = -(-max(1, max_seq_len) // num_splits)
    tokens_per_split = -(-tokens_per_split // BLOCK_N) * BLOCK_N
    acc = torch.empty(n, heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    stats = torch.empty(2, n, heads, num_splits, dtype=torch.float32, device=q.device)
    mla_decode_partials[(n, head_blocks, num_splits)](
        q, kv_cache, block_table, seq_lens, acc, stats, scale,
        q.stride(0), q.stride(1), block_table.stride(0), acc.stride(0), acc.stride(1),
        acc.stride(2), stats.stride(0), stats.stride(1), stats.stride(2),
        heads, kv_lora_rank, width, kv_cache.shape[1], tokens_per_split,
        BLOCK_H=block_h, BLOCK_N=BLOCK_N, BLOCK_L=_next_pow2(kv_lora_rank),
        BLOCK_R=_next_pow2(width - kv_lora_rank),
    )
    # Merge the splits: each partial is scaled to the common maximum (empty splits weigh 0).
    m, lse = stats[0], stats[1]
    weights = torch.exp(m - m.amax(-1, keepdim=True))  # [N, heads, splits]
    total = (weights * lse).sum(-1, keepdim=True)
    return (weights[..., None] * acc).sum(2) / total


class TritonMLAImpl(TorchMLAImpl):
    """TORCH_MLA with the decodes (the batched requests, one new token each) in Triton."""

    def _attend_absorbed(self, query: torch.Tensor, kv_cache: torch.Tensor, b: BatchedRequests
                         ) -> torch.Tensor:
        # The builder batches only requests with one new token (MLA has no soft-cap), so the
        # batched tokens are the requests, in order.
        d = self.dims
        w_uk, w_uv = self.up_weights()
        q_nope, q_pe = query.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        q = torch.cat((torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe), dim=-1).contiguous()
        o_lat = mla_decode(q, kv_cache, b.block_table, b.seq_lens, self.scale, d.kv_lora_rank,
                           b.max_seq_len)
        return torch.einsum("thr,hvr->thv", o_lat.to(query.dtype), w_uv)


class TritonMLABackend(TorchMLABackend):
    """Paged MLA with a Triton decode kernel; NVIDIA GPUs (sm_80+), or Triton's CPU
    interpreter for tests."""

    name: ClassVar[str] = "TRITON_MLA"
    priority: ClassVar[int] = 110

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        device_reasons = triton_device_reasons(spec)
        if importlib.util.find_spec("triton") is None:
            return device_reasons
        reasons = mla_reasons(spec) + device_reasons
        if spec.kv_cache_dtype != spec.dtype:
            reasons.append(f"KV-cache dtype {spec.kv_cache_dtype} is not supported: TRITON_MLA "
                           "reads the latent in the model dtype (use kv_cache_dtype=auto)")
        if spec.logits_soft_cap is not None:
            reasons.append("logits soft-capping is not supported with MLA")
        return reasons

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TritonMLAImpl
