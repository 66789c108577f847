"""A paged-attention test bench: random paged caches with permuted blocks, batches of
prefill / chunked-prefill / decode requests, and a float64 reference computed per request."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hitchllm.attention import CommonAttentionMetadata


@dataclass
class PagedBatch:
    """One step's inputs plus what the reference needs to check the output."""

    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, Hkv, D] new tokens
    value: torch.Tensor
    common: CommonAttentionMetadata
    full_keys: list[torch.Tensor]  # per request: [seq_len, Hkv, D] (cached + new)
    full_values: list[torch.Tensor]
    context_lens: list[int]
    query_lens: list[int]


def make_batch(
    context_lens: list[int], query_lens: list[int], num_heads: int, num_kv_heads: int,
    head_size: int, block_size: int, num_blocks: int, kv_cache: torch.Tensor,
    dtype: torch.dtype, seed: int = 0, write_context=None,
) -> PagedBatch:
    """Fill the cache with each request's first ``context_lens[i]`` tokens (at slots chosen
    through a random block permutation) and build the step that adds ``query_lens[i]`` more.
    ``write_context(flat_slots, k, v)`` stores context K/V in the backend's layout."""
    g = torch.Generator().manual_seed(seed)
    device = kv_cache.device
    n = len(context_lens)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    perm = torch.randperm(num_blocks, generator=g)
    assert sum(blocks_per_req) <= num_blocks
    max_blocks = max(blocks_per_req)
    block_table = torch.zeros(n, max_blocks, dtype=torch.int32)
    start = 0
    for i, nb in enumerate(blocks_per_req):
        block_table[i, :nb] = perm[start:start + nb].to(torch.int32)
        start += nb

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    full_k = [rand(s, num_kv_heads, head_size) for s in seq_lens]
    full_v = [rand(s, num_kv_heads, head_size) for s in seq_lens]
    for i, c in enumerate(context_lens):
        if c:
            pos = torch.arange(c)
            slots = block_table[i, pos // block_size].long() * block_size + pos % block_size
            write_context(slots.to(device), full_k[i][:c].to(dtype).to(device),
                          full_v[i][:c].to(dtype).to(device))
    queries = [rand(q, num_heads, head_size) for q in query_lens]
    slot_list = []
    for i, (c, q) in enumerate(zip(context_lens, query_lens)):
        pos = torch.arange(c, c + q)
        slot_list.append(block_table[i, pos // block_size].long() * block_size + pos % block_size)
    qsl = torch.zeros(n + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    seq = torch.tensor(seq_lens, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
        seq_lens=seq.to(device), seq_lens_cpu=seq,
        num_computed_tokens_cpu=torch.tensor(context_lens, dtype=torch.int32),
        block_table=block_table.to(device), slot_mapping=torch.cat(slot_list).to(device),
        num_reqs=n, num_actual_tokens=int(qsl[-1]), max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
    )
    new_k = torch.cat([k[c:] for k, c in zip(full_k, context_lens)])
    new_v = torch.cat([v[c:] for v, c in zip(full_v, context_lens)])
    return PagedBatch(
        query=torch.cat(queries).to(dtype).to(device), key=new_k.to(dtype).to(device),
        value=new_v.to(dtype).to(device), common=common, full_keys=full_k, full_values=full_v,
        context_lens=context_lens, query_lens=query_lens,
    )


def reference_attention(batch: PagedBatch, scale: float, sliding_window: int | None = None,
                        soft_cap: float | None = None, dtype=torch.float64) -> torch.Tensor:
    """float64 causal attention of each request's new queries over its full sequence, using
    the values actually stored (``dtype`` rounding) so only the kernel's arithmetic differs."""
    outs = []
    start = 0
    for k, v, c, q in zip(batch.full_keys, batch.full_values, batch.context_lens,
                          batch.query_lens):
        query = batch.query[start:start + q].cpu().double()
        start += q
        k = k.to(dtype).double()
        v = v.to(dtype).double()
        group = query.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", query, k) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        qpos = torch.arange(c, c + q)[:, None]
        kpos = torch.arange(c + q)[None, :]
        allowed = kpos <= qpos
        if sliding_window is not None:
            allowed &= qpos - kpos < sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), v))
    return torch.cat(outs)
