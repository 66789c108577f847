"""AWQ's GEMM packing of int4 weights, and round-to-nearest group quantization into it.

A linear layer ``y = x @ W.T`` with ``W`` of shape ``[out_features, in_features]`` is stored as
three tensors (``G = group_size``, ``K = in_features``, ``N = out_features``):

- ``qweight``: int32 ``[K, N // 8]``, the int4 values ``q`` of ``W.T`` (input-major), eight
  consecutive output columns per int32;
- ``qzeros``: int32 ``[K // G, N // 8]``, the int4 zero points ``z``, packed the same way;
- ``scales``: float16 ``[K // G, N]``.

Dequantized: ``W.T[k, n] = (q[k, n] - z[k // G, n]) * scales[k // G, n]``.

Nibble order (the "interleaved" order of AutoAWQ's GEMM kernels): in the int32 that holds
output columns ``8c .. 8c + 7``, the nibble at bits ``4i .. 4i + 3`` holds column
``8c + AWQ_ORDER[i]`` with ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``; equivalently column
``8c + j`` sits in nibble ``AWQ_REVERSE_ORDER[j]`` with ``AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2,
6, 3, 7]``. Source: AutoAWQ, ``awq/utils/packing_utils.py`` (``AWQ_ORDER``,
``AWQ_REVERSE_ORDER``, ``unpack_awq``/``reverse_awq_order``) and the GEMM packing in
``awq/modules/linear/gemm.py`` (``order_map = [0, 2, 4, 6, 1, 3, 5, 7]``, value of column
``order_map[i]`` shifted by ``i * 4``). The values are unsigned, ``0 .. 15``.
"""

from __future__ import annotations

import torch

PACK_FACTOR = 8  # int4 values per int32
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack unsigned int4 ``values`` ``[rows, cols]`` (``cols`` a multiple of 8) into int32
    ``[rows, cols // 8]`` in AWQ's nibble order."""
    rows, cols = values.shape
    if cols % PACK_FACTOR:
        raise ValueError(f"{cols} columns cannot be packed 8 to an int32")
    if values.min() < 0 or values.max() > 15:
        raise ValueError("int4 values must lie in 0 .. 15")
    grouped = values.to(torch.int64).reshape(rows, cols // PACK_FACTOR, PACK_FACTOR)
    nibbles = grouped[..., list(AWQ_ORDER)]  # nibble i holds column AWQ_ORDER[i]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (nibbles << shifts).sum(-1)
    # Reinterpret as two's complement int32: nibble 7 sets the sign bit.
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int4 values ``[rows, cols * 8]`` (int32, ``0 .. 15``) of AWQ-packed ``packed``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF
    return nibbles[..., list(AWQ_REVERSE_ORDER)].reshape(packed.shape[0], -1)


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               group_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight ``W`` ``[out_features, in_features]`` of AWQ tensors, computed in
    float32 (exact: a float16 scale times an int4 difference fits its 24-bit significand) and
    returned in ``dtype``."""
    q = unpack_int4(qweight)
    z = unpack_int4(qzeros).repeat_interleave(group_size, dim=0)
    s = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - z).float() * s).to(dtype).T


def quantize_rtn(weight: torch.Tensor, group_size: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 quantization of ``weight`` ``[out, in]``, per group of
    ``group_size`` input columns and output row: ``(qweight, qzeros, scales)`` in AWQ's GEMM
    packing. Each group's range ``[min, max]`` (widened to include 0) maps onto ``0 .. 15``:
    ``scale = (max - min) / 15``, ``zero = round(-min / scale)``. Not activation-aware: AWQ's
    per-channel scale search is not done."""
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group_size {group_size} does not divide in_features {in_features}")
    groups = weight.float().T.reshape(in_features // group_size, group_size, out_features)
    low = groups.amin(1).clamp(max=0)
    high = groups.amax(1).clamp(min=0)
    scales = ((high - low) / 15).clamp(min=1e-6).to(torch.float16)
    s = scales.float()
    zeros = (-low / s).round().clamp(0, 15)
    q = (groups / s[:, None] + zeros[:, None]).round().clamp(0, 15)
    q = q.reshape(in_features, out_features).to(torch.int32)
    return pack_int4(q), pack_int4(zeros.to(torch.int32)), scales


def pack_along_k(qweight: torch.Tensor, qzeros: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ's GEMM packing re-laid out for the Triton kernels (``awq_triton``): the int4 values
    packed eight consecutive *input* rows to an int32, in plain nibble order (nibble ``i`` of
    word ``[r, n]`` holds ``q[8r + i, n]``), as int32 ``[K // 8, N]``; the zero points unpacked
    to uint8 ``[K // G, N]``. The same values, so the same products: only the kernels read it."""
    q = unpack_int4(qweight)
    k, n = q.shape
    if k % PACK_FACTOR:
        raise ValueError(f"{k} input rows cannot be packed 8 to an int32")
    rows = q.to(torch.int64).reshape(k // PACK_FACTOR, PACK_FACTOR, n)
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=q.device)[:, None]
    words = (rows << shifts).sum(1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return words.contiguous(), unpack_int4(qzeros).to(torch.uint8).contiguous()


def unpack_along_k(words: torch.Tensor) -> torch.Tensor:
    """The int4 values ``[K, N]`` (int32, ``0 .. 15``) of ``pack_along_k``'s ``words``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=words.device)[:, None]
    nibbles = (words.unsqueeze(1) >> shifts) & 0xF
    return nibbles.reshape(-1, words.shape[1])
