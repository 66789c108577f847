"""TORCH: paged attention in plain PyTorch, the reference every other backend is tested against.

It runs anywhere PyTorch runs and supports everything the core supports (GQA, sliding window,
logits soft-cap, chunked prefill over a cached prefix, mixed prefill/decode batches). It is
written for clarity, not speed: each step gathers every request's context from the paged
cache into a padded [num_reqs, max_seq_len] tensor and attends with one masked SDPA call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from hitchllm.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionSpec,
    CommonAttentionMetadata,
)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class TorchAttentionMetadata:
    """Per-step metadata for the TORCH backend."""

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_reqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_reqs] int64
    context_lens: torch.Tensor  # [num_reqs] int64: tokens cached before this step
    token_req: torch.Tensor  # [num_tokens] int64: which request each packed token belongs to
    token_qpos: torch.Tensor  # [num_tokens] int64: index of the token within its request's query
    num_reqs: int
    max_query_len: int
    max_seq_len: int


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder):
    """Computes each packed token's (request, query position) once per step, on the host."""

    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        n = common.num_reqs
        qsl = common.query_start_loc_cpu[: n + 1].long()
        query_lens = qsl[1:] - qsl[:-1]
        num_tokens = common.num_actual_tokens
        token_req = torch.repeat_interleave(torch.arange(n), query_lens, output_size=num_tokens)
        token_qpos = torch.arange(num_tokens) - qsl[:-1][token_req]
        return TorchAttentionMetadata(
            slot_mapping=common.slot_mapping[:num_tokens],
            block_table=common.block_table[:n],
            seq_lens=common.seq_lens[:n].long(),
            context_lens=common.num_computed_tokens_cpu[:n].long().to(
                self.device, non_blocking=True
            ),
            token_req=token_req.to(self.device, non_blocking=True),
            token_qpos=token_qpos.to(self.device, non_blocking=True),
            num_reqs=n,
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
        )


class TorchAttentionImpl(AttentionImpl):
    """Masked SDPA over each request's context gathered from the paged cache."""

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchAttentionMetadata,
    ) -> torch.Tensor:
        # Head-major layout [kv_heads, blocks, block_size, d]: gathering a request's blocks
        # for one head yields its context as one contiguous [len, d] matrix.
        key_cache, value_cache = kv_cache.unbind(0)
        block_size = key_cache.shape[2]
        flat_k = key_cache.view(self.num_kv_heads, -1, self.head_size)
        flat_v = value_cache.view(self.num_kv_heads, -1, self.head_size)
        # The cache holds one extra block at the end: padding slots (-1) are redirected there
        # so the write needs no data-dependent indexing (which would sync with the host).
        sink = flat_k.shape[1] - block_size
        slots = metadata.slot_mapping
        slots = torch.where(slots < 0, torch.full_like(slots, sink), slots)
        flat_k.index_copy_(1, slots, key.transpose(0, 1).to(flat_k.dtype))
        flat_v.index_copy_(1, slots, value.transpose(0, 1).to(flat_v.dtype))

        n, max_q, max_k = metadata.num_reqs, metadata.max_query_len, metadata.max_seq_len
        # Whole blocks are gathered (one contiguous copy per block and head).
        num_cols = min(-(-max_k // block_size), metadata.block_table.shape[1])
        blocks = metadata.block_table[:, :num_cols].reshape(-1).long()
        shape = (self.num_kv_heads, n, num_cols * block_size, self.head_size)
        k = key_cache.index_select(1, blocks).view(shape)[:, :, :max_k].to(query.dtype)
        v = value_cache.index_select(1, blocks).view(shape)[:, :, :max_k].to(query.dtype)

        q = query.new_zeros(n, max_q, self.num_heads, self.head_size)
        q[metadata.token_req, metadata.token_qpos] = query
        q = q.transpose(1, 2)  # [n, heads, max_q, d]

        kpos = torch.arange(max_k, device=query.device)
        qpos = metadata.context_lens[:, None] + torch.arange(max_q, device=query.device)
        kp = kpos[None, None, :]
        allowed = (kp <= qpos[:, :, None]) & (kp < metadata.seq_lens[:, None, None])
        if self.spec.sliding_window is not None:
            allowed &= qpos[:, :, None] - kp < self.spec.sliding_window
        allowed = allowed[:, None]  # broadcast over heads

        if self.spec.logits_soft_cap is None and max_q > 1:
            out = F.scaled_dot_product_attention(
                q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=allowed, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        else:
            # Decode steps (and soft-capping): small score tensors, so a grouped matmul that
            # never expands K/V to every query head is cheaper than SDPA's masked path.
            out = self._grouped(q, k, v, allowed)
        return out.transpose(1, 2)[metadata.token_req, metadata.token_qpos]

    def _grouped(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor
    ) -> torch.Tensor:
        n, _, max_q, d = q.shape
        group = self.num_heads // self.num_kv_heads
        # [kv_heads, n, group * max_q, d]: the query heads of a group share their K/V, which
        # arrive as [kv_heads, n, len, d], so the batched matmuls need no copies.
        qg = q.reshape(n, self.num_kv_heads, group * max_q, d).transpose(0, 1)
        scores = (qg @ k.transpose(-1, -2)).transpose(0, 1).float() * self.scale
        if self.spec.logits_soft_cap is not None:
            cap = self.spec.logits_soft_cap
            scores = cap * torch.tanh(scores / cap)
        scores = scores.view(n, self.num_kv_heads, group, max_q, -1)
        scores = scores.masked_fill(~allowed[:, :, None], float("-inf"))
        probs = scores.softmax(-1).to(v.dtype).view(n, self.num_kv_heads, group * max_q, -1)
        out = probs.transpose(0, 1) @ v  # [kv_heads, n, group * max_q, d]
        return out.transpose(0, 1).reshape(n, self.num_heads, max_q, d)


class TorchAttentionBackend(AttentionBackend):
    """Pure-PyTorch paged attention; the default on machines with no accelerator plugin."""

    name: ClassVar[str] = "TORCH"
    priority: ClassVar[int] = 0

    @classmethod
    def validate(cls, spec: AttentionSpec) -> list[str]:
        reasons = []
        if spec.use_mla:
            reasons.append("MLA models need an MLA backend (install hitchllm-attention-mla)")
        if spec.dtype not in _SUPPORTED_DTYPES:
            reasons.append(f"dtype {spec.dtype} is not supported (use float32/float16/bfloat16)")
        if spec.num_heads % spec.num_kv_heads:
            reasons.append(
                f"{spec.num_heads} query heads are not a multiple of {spec.num_kv_heads} KV heads"
            )
        return reasons

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        # Head-major; one extra block absorbs writes of padding slots (see
        # TorchAttentionImpl.forward).
        return (2, num_kv_heads, num_blocks + 1, block_size, head_size)

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchAttentionImpl

    @classmethod
    def get_builder_cls(cls) -> type[AttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder
