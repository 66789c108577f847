"""Grouped LoRA kernels in Triton: ``lora_shrink`` (``x @ A.T``, times the adapter's
scaling) and ``lora_expand`` (``out += y @ B.T``) for a batch whose tokens use different
adapters, one kernel family for prefill segments and decode rows alike.

Every adapter occupies a *slot* of a stacked pool (``lora_a [S, R, H_in]``,
``lora_b [S, N, R]``; ``R`` is the pool's rank, rows past an adapter's own rank are zero) and
``token_slot [T]`` names each token's slot, ``-1`` for tokens of the base model.

**Grouping.** ``group_tokens`` sorts the tokens by slot once (a stable ``argsort`` on the
device, tokens without an adapter last) and cuts each slot's run of tokens into tiles of
``block_t`` tokens. Prefill tokens of one request form one long run already; decode rows of
requests that share an adapter end up in one run too, so each tile reads its adapter's
weights once for up to ``block_t`` tokens (what SGMV does for segments and BGMV for rows). The
tile table has a fixed length, ``cdiv(T, block_t) + min(S, T)`` (an upper bound on the tiles
any assignment needs: each slot's last tile may be partial), so every grid depends on shapes
only; surplus tiles and the tokens without an adapter have no tile: their programs return at
once and write nothing. All of it is torch ops on the device with no host read of a device
value, so the kernels may be captured in a CUDA graph. The table depends only on
``token_slot``: build it once per step (``group_tokens``) and pass it as ``groups=`` to every
layer's calls; without it each call builds its own.

**Shrink.** A program owns one tile and one share of ``H_in`` (split-K, for batches with too
few tiles to fill the GPU); it gathers the tile's rows of ``x``, multiplies them with its
slot's ``A`` (``tl.dot``, float32 accumulation) over its share and adds
``scaling[slot] * partial`` into a zeroed float32 ``y`` (atomically when split).

**Expand.** A program owns one tile and ``BLOCK_N`` output columns; it multiplies the tile's
rows of ``y`` (float32) with its slot's ``B`` (widened to float32; TF32 tensor cores for
16-bit weights, exact IEEE products for float32 ones) and adds the result into its rows of
``out[:, out_offset:out_offset + N]``, rounding once to ``out``'s dtype. Each output element
belongs to one program, so no atomics are needed; the fused QKV and gate/up outputs take one
call per slice. Their ``A`` may be stacked into one pool (``[S, R_q + R_k + R_v, H_in]``) and
shrunk in one call: each slice's expand then reads its columns of ``y`` through a view.

``R`` up to ``MAX_RANK`` is handled by padding to a power of two (at least 16, ``tl.dot``'s
minimum) under masks; ``H_in`` and ``N`` need not be multiples of the block sizes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_RANK = 128  # the widest rank (or stack of ranks, e.g. q/k/v's A side by side) supported


@dataclass(frozen=True)
class SlotGroups:
    """Tokens grouped by slot into tiles of ``block_t`` (see the module docstring).

    ``order [T]`` int32 holds token indices sorted by slot; tile ``g`` covers
    ``order[tile_start[g]:tile_end[g]]``, all of slot ``tile_slot[g]`` (``-1``: a surplus
    tile, nothing to do). The tile tensors have ``cdiv(T, block_t) + min(S, T)`` entries.
    """

    order: torch.Tensor
    tile_slot: torch.Tensor
    tile_start: torch.Tensor
    tile_end: torch.Tensor
    block_t: int
    num_slots: int

    @property
    def num_tokens(self) -> int:
        return self.order.shape[0]

    @property
    def num_tiles(self) -> int:
        return self.tile_slot.shape[0]


def default_block_t(num_tokens: int) -> int:
    """Tokens per tile: small tiles for small (decode) batches, where a slot's run is short;
    larger ones for big batches, so that long runs read each adapter's weights fewer times."""
    if num_tokens <= 128:
        return 16
    return 32 if num_tokens <= 512 else 64


def group_tokens(token_slot: torch.Tensor, num_slots: int,
                 block_t: int | None = None) -> SlotGroups:
    """Sort ``token_slot``'s tokens by slot and cut each slot's run into tiles of
    ``block_t`` (default ``default_block_t(T)``) tokens, on ``token_slot``'s device without a
    host sync. Slots outside ``[0, num_slots)`` count as ``-1`` (checking them on the host
    would need a sync)."""
    if token_slot.dim() != 1 or token_slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slot must be a 1-D int32 or int64 tensor, got shape "
                         f"{tuple(token_slot.shape)} and dtype {token_slot.dtype}")
    if num_slots < 1:
        raise ValueError(f"num_slots must be at least 1, got {num_slots}")
    num_tokens = token_slot.shape[0]
    block_t = block_t or default_block_t(num_tokens)
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two of at least 16, got {block_t}")
    device = token_slot.device
    slot = token_slot.to(torch.int64)
    # Tokens without an adapter get the key num_slots: they sort last and get no tile.
    key = torch.where((slot < 0) | (slot >= num_slots), num_slots, slot)
    order = torch.argsort(key, stable=True).to(torch.int32)
    counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:num_slots]
    run_end = counts.cumsum(0)
    tiles_per_slot = (counts + block_t - 1) // block_t
    tiles_end = tiles_per_slot.cumsum(0)
    num_tiles = triton.cdiv(num_tokens, block_t) + min(num_slots, num_tokens)
    tile = torch.arange(num_tiles, dtype=torch.int64, device=device)
    tile_slot = torch.searchsorted(tiles_end, tile, right=True)  # num_slots: a surplus tile
    used = tile_slot < num_slots
    slot_of = tile_slot.clamp(max=num_slots - 1)
    tile_in_run = tile - (tiles_end - tiles_per_slot)[slot_of]
    start = (run_end - counts)[slot_of] + tile_in_run * block_t
    end = torch.minimum(start + block_t, run_end[slot_of])
    return SlotGroups(order=order,
                      tile_slot=torch.where(used, tile_slot, -1).to(torch.int32),
                      tile_start=start.to(torch.int32), tile_end=end.to(torch.int32),
                      block_t=block_t, num_slots=num_slots)


@triton.jit
def _tile_tokens(order_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_T: tl.constexpr):
    """The tile's token indices (int64) and which of its ``BLOCK_T`` rows are in use."""
    rows = tl.load(tile_start_ptr + tile) + tl.arange(0, BLOCK_T)
    in_tile = rows < tl.load(tile_end_ptr + tile)
    tokens = tl.load(order_ptr + rows, mask=in_tile, other=0).to(tl.int64)
    return tokens, in_tile


@triton.jit
def lora_shrink_kernel(
    x_ptr, a_ptr, scaling_ptr, y_ptr,
    order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    H, R,
    stride_xt, stride_xh, stride_as, stride_ar, stride_ah, stride_yt,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Tile ``program_id(0)``, ``H`` share ``program_id(1)``:
    ``y[tokens] += scaling[slot] * x[tokens, share] @ A[slot, :, share].T``."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    tokens, in_tile = _tile_tokens(order_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_T)
    rr = tl.arange(0, BLOCK_R)
    k_tiles = tl.cdiv(H, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    first = tl.program_id(1) * per_split
    last = tl.minimum(first + per_split, k_tiles)
    a_slot = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_T, BLOCK_R), dtype=tl.float32)
    for t in range(first, last):
        rk = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        x = tl.load(x_ptr + tokens[:, None] * stride_xt + rk[None, :] * stride_xh,
                    mask=in_tile[:, None] & k_ok[None, :], other=0.0)
        a = tl.load(a_slot + rk[:, None] * stride_ah + rr[None, :] * stride_ar,
                    mask=k_ok[:, None] & (rr < R)[None, :], other=0.0)
        acc += tl.dot(x, a.to(x.dtype), input_precision=DOT_PRECISION)
    acc *= tl.load(scaling_ptr + slot)
    y = y_ptr + tokens[:, None] * stride_yt + rr[None, :]
    mask = in_tile[:, None] & (rr < R)[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y, acc, mask=mask)
    else:
        tl.store(y, acc, mask=mask)


@triton.jit
def lora_expand_kernel(
    y_ptr, b_ptr, out_ptr,
    order_ptr, tile_slot_ptr, tile_start_ptr, tile_end_ptr,
    N, R, out_offset,
    stride_yt, stride_yr, stride_bs, stride_bn, stride_br, stride_ot, stride_on,
    BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Tile ``program_id(0)``, columns ``program_id(1)``:
    ``out[tokens, out_offset + cols] += y[tokens] @ B[slot, cols].T``."""
    tile = tl.program_id(0)
    slot = tl.load(tile_slot_ptr + tile)
    if slot < 0:
        return
    tokens, in_tile = _tile_tokens(order_ptr, tile_start_ptr, tile_end_ptr, tile, BLOCK_T)
    rr = tl.arange(0, BLOCK_R)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    y = tl.load(y_ptr + tokens[:, None] * stride_yt + rr[None, :] * stride_yr,
                mask=in_tile[:, None] & (rr < R)[None, :], other=0.0)
    b = tl.load(b_ptr + slot.to(tl.int64) * stride_bs + rr[:, None] * stride_br
                + rn[None, :] * stride_bn, mask=(rr < R)[:, None] & n_ok[None, :], other=0.0)
    delta = tl.dot(y, b.to(tl.float32), input_precision=DOT_PRECISION)
    out = out_ptr + tokens[:, None] * stride_ot + (out_offset + rn)[None, :] * stride_on
    mask = in_tile[:, None] & n_ok[None, :]
    current = tl.load(out, mask=mask, other=0.0)
    tl.store(out, (current.to(tl.float32) + delta).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter: a few programs per tile, enough to exercise split-K
    return torch.cuda.get_device_properties(device).multi_processor_count


def _rank_block(rank: int) -> int:
    return max(16, triton.next_power_of_2(rank))


def _groups_for(token_slot: torch.Tensor, num_slots: int, num_tokens: int,
                groups: SlotGroups | None) -> SlotGroups:
    if groups is None:
        return group_tokens(token_slot, num_slots)
    if (groups.num_tokens, groups.num_slots) != (num_tokens, num_slots):
        raise ValueError(f"groups were built for {groups.num_tokens} tokens and "
                         f"{groups.num_slots} slots, the call has {num_tokens} tokens and a "
                         f"pool of {num_slots} slots: build them with group_tokens(token_slot, "
                         f"{num_slots}) from this batch's token_slot")
    return groups


def _check_token_slot(token_slot: torch.Tensor, num_tokens: int) -> None:
    if token_slot.shape != (num_tokens,) or token_slot.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_slot must be an int32 or int64 tensor of shape ({num_tokens},),"
                         f" got shape {tuple(token_slot.shape)} and dtype {token_slot.dtype}")


def _check_rank(rank: int) -> None:
    if not 1 <= rank <= MAX_RANK:
        raise ValueError(f"LoRA rank {rank} is outside 1..{MAX_RANK}: lower max_lora_rank")


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slot: torch.Tensor,
                scaling: torch.Tensor, *, groups: SlotGroups | None = None,
                split_k: int | None = None) -> torch.Tensor:
    """``y [T, R]`` float32 with ``y[t] = scaling[s] * x[t] @ lora_a[s].T`` for
    ``s = token_slot[t]``; zero where ``s`` is ``-1``.

    ``x [T, H_in]``; ``lora_a [S, R, H_in]``; ``token_slot [T]`` int32/int64; ``scaling [S]``
    float32. ``groups``: ``group_tokens(token_slot, S)``, shared by a step's calls (built here
    when omitted). ``split_k``: shares of ``H_in`` per tile (default: enough programs to fill
    the GPU).
    """
    if x.dim() != 2 or lora_a.dim() != 3 or lora_a.shape[2] != x.shape[1]:
        raise ValueError(f"x must be [T, H_in] and lora_a [S, R, H_in], got "
                         f"{tuple(x.shape)} and {tuple(lora_a.shape)}")
    num_slots, rank, hidden = lora_a.shape
    num_tokens = x.shape[0]
    _check_rank(rank)
    _check_token_slot(token_slot, num_tokens)
    if scaling.shape != (num_slots,):
        raise ValueError(f"scaling must have shape ({num_slots},), one per slot of lora_a, "
                         f"got {tuple(scaling.shape)}")
    y = torch.zeros(num_tokens, rank, dtype=torch.float32, device=x.device)
    if num_tokens == 0:
        return y
    groups = _groups_for(token_slot, num_slots, num_tokens, groups)
    cuda = x.device.type == "cuda"
    block_k = 128 if cuda else 32
    k_tiles = triton.cdiv(hidden, block_k)
    if split_k is None:
        split_k = 2 * _multiprocessors(x.device) // groups.num_tiles
    split_k = max(1, min(split_k, k_tiles))
    lora_shrink_kernel[(groups.num_tiles, split_k)](
        x, lora_a, scaling.to(torch.float32), y,
        groups.order, groups.tile_slot, groups.tile_start, groups.tile_end,
        hidden, rank,
        x.stride(0), x.stride(1), *lora_a.stride(), y.stride(0),
        BLOCK_T=groups.block_t, BLOCK_R=_rank_block(rank), BLOCK_K=block_k,
        SPLIT_K=split_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=3 if cuda else 1,
    )
    return y


def lora_expand(y: torch.Tensor, lora_b: torch.Tensor, token_slot: torch.Tensor,
                out: torch.Tensor, out_offset: int = 0, *,
                groups: SlotGroups | None = None) -> None:
    """In place: ``out[t, out_offset:out_offset + N] += y[t] @ lora_b[s].T`` for
    ``s = token_slot[t]``; rows with ``s = -1`` are left alone.

    ``y [T, R]`` float32 (``lora_shrink``'s result); ``lora_b [S, N, R]``; ``out [T, >= N]``
    of any dtype and strides (a fused QKV or gate/up output takes one call per slice). The
    sum is formed in float32 and rounded once to ``out``'s dtype. ``groups`` as for
    ``lora_shrink``.
    """
    if y.dim() != 2 or lora_b.dim() != 3 or lora_b.shape[2] != y.shape[1]:
        raise ValueError(f"y must be [T, R] and lora_b [S, N, R], got {tuple(y.shape)} and "
                         f"{tuple(lora_b.shape)}")
    if y.dtype != torch.float32:
        raise ValueError(f"y must be float32 (lora_shrink's output), got {y.dtype}")
    num_slots, width, rank = lora_b.shape
    num_tokens = y.shape[0]
    _check_rank(rank)
    _check_token_slot(token_slot, num_tokens)
    if out.dim() != 2 or out.shape[0] != num_tokens:
        raise ValueError(f"out must be [{num_tokens}, >= {width}], got {tuple(out.shape)}")
    if out_offset < 0 or out_offset + width > out.shape[1]:
        raise ValueError(f"columns {out_offset}..{out_offset + width} of the slice do not fit "
                         f"in out's {out.shape[1]} columns: check out_offset")
    if num_tokens == 0:
        return
    groups = _groups_for(token_slot, num_slots, num_tokens, groups)
    cuda = y.device.type == "cuda"
    block_n = 128 if cuda else 32
    if cuda and groups.num_tiles * triton.cdiv(width, block_n) < 2 * _multiprocessors(y.device):
        block_n = 64  # small batches: more, narrower programs
    lora_expand_kernel[(groups.num_tiles, triton.cdiv(width, block_n))](
        y, lora_b, out,
        groups.order, groups.tile_slot, groups.tile_start, groups.tile_end,
        width, rank, out_offset,
        *y.stride(), *lora_b.stride(), *out.stride(),
        BLOCK_T=groups.block_t, BLOCK_R=_rank_block(rank), BLOCK_N=block_n,
        DOT_PRECISION="ieee" if lora_b.dtype == torch.float32 else "tf32",
        num_warps=4, num_stages=2 if cuda else 1,
    )
