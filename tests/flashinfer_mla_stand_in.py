"""A stand-in for ``flashinfer.mla.BatchMLAPagedAttentionWrapper`` on machines without
FlashInfer (it is a GPU package): FlashInfer's documented paged MLA semantics, written from the
definition in PyTorch, one request at a time, with checks of the inputs FlashInfer requires.

Semantics (FlashInfer's docs and kernels): request ``i`` owns query rows
``qo_indptr[i]:qo_indptr[i + 1]`` and pages ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` of
``page_size`` tokens, of which its first ``kv_len_arr[i]`` are its context. Scores are
``sm_scale * (q_nope . ckv + q_pe . kpe)``; with ``causal`` query row ``j`` of a request with
``q_len`` rows sees tokens ``0 .. kv_len - q_len + j`` (the mask aligned to the end). The
output is ``softmax(scores) @ ckv`` in the query dtype. ``plan`` copies its inputs (the real
one copies them to the device), so the caller may reuse its buffers afterwards.

The tests install it as the ``flashinfer`` package with ``install_stand_in``.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import torch

#: Every wrapper built, newest last (tests read their plans).
WRAPPERS: list[BatchMLAPagedAttentionWrapper] = []


class BatchMLAPagedAttentionWrapper:
    """The stand-in wrapper; ``plans`` records every ``plan`` call's arguments."""

    def __init__(self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
                 **buffers: Any) -> None:
        assert not use_cuda_graph, "FLASHINFER_MLA plans eager wrappers only"
        self.device = float_workspace_buffer.device
        self.plans: list[dict[str, Any]] = []
        WRAPPERS.append(self)

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
             kv_len_arr: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int,
             page_size: int, causal: bool, sm_scale: float, q_data_type: torch.dtype,
             kv_data_type: torch.dtype) -> None:
        for name, t in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr),
                        ("kv_indices", kv_indices), ("kv_len_arr", kv_len_arr)):
            assert t.dtype == torch.int32, (name, t.dtype)
        n = len(kv_len_arr)
        assert len(qo_indptr) == len(kv_indptr) == n + 1
        assert int(kv_indptr[-1]) <= len(kv_indices)
        pages = kv_indptr[1:] - kv_indptr[:-1]
        assert torch.equal(pages, -(-kv_len_arr // page_size)), "pages do not cover kv_len"
        self.plans.append(dict(
            qo_indptr=qo_indptr.clone(), kv_indptr=kv_indptr.clone(),
            kv_indices=kv_indices.clone(), kv_len_arr=kv_len_arr.clone(), num_heads=num_heads,
            head_dim_ckv=head_dim_ckv, head_dim_kpe=head_dim_kpe, page_size=page_size,
            causal=causal, sm_scale=sm_scale, q_data_type=q_data_type,
            kv_data_type=kv_data_type))

    def run(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
            kpe_cache: torch.Tensor) -> torch.Tensor:
        p = self.plans[-1]
        tokens = int(p["qo_indptr"][-1])
        assert q_nope.shape == (tokens, p["num_heads"], p["head_dim_ckv"]), q_nope.shape
        assert q_pe.shape == (tokens, p["num_heads"], p["head_dim_kpe"]), q_pe.shape
        assert q_nope.dtype == q_pe.dtype == p["q_data_type"]
        assert ckv_cache.dtype == kpe_cache.dtype == p["kv_data_type"]
        assert ckv_cache.shape[1:] == (p["page_size"], p["head_dim_ckv"]), ckv_cache.shape
        assert kpe_cache.shape[1:] == (p["page_size"], p["head_dim_kpe"]), kpe_cache.shape
        assert ckv_cache.stride(-1) == kpe_cache.stride(-1) == 1  # 16-byte vector loads
        qo, kv = p["qo_indptr"].tolist(), p["kv_indptr"].tolist()
        out = torch.empty_like(q_nope)
        for i, kv_len in enumerate(p["kv_len_arr"].tolist()):
            pages = p["kv_indices"][kv[i]: kv[i + 1]].long()
            ckv = ckv_cache[pages].flatten(0, 1)[:kv_len].float()
            kpe = kpe_cache[pages].flatten(0, 1)[:kv_len].float()
            rows = slice(qo[i], qo[i + 1])
            scores = (torch.einsum("qhc,kc->hqk", q_nope[rows].float(), ckv)
                      + torch.einsum("qhr,kr->hqk", q_pe[rows].float(), kpe)) * p["sm_scale"]
            if p["causal"]:
                q_len = qo[i + 1] - qo[i]
                last = kv_len - q_len + torch.arange(q_len)[:, None]
                scores = scores.masked_fill(torch.arange(kv_len)[None] > last, float("-inf"))
            out[rows] = torch.einsum("hqk,kc->qhc", scores.softmax(-1), ckv).to(out.dtype)
        return out


def install_stand_in(root: Path, broken: bool = False) -> None:
    """Write a ``flashinfer`` package under ``root`` whose ``mla`` module is this stand-in
    (or, ``broken``, fails to import as a build for another torch would), and make it
    importable; the caller puts ``root`` on ``sys.path`` and calls ``remove_stand_in`` after."""
    package = root / "flashinfer"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    body = ("raise ImportError('libflashinfer.so: undefined symbol _ZN3c10')\n" if broken
            else "from flashinfer_mla_stand_in import BatchMLAPagedAttentionWrapper\n")
    (package / "mla.py").write_text(body)
    importlib.invalidate_caches()
    WRAPPERS.clear()


def remove_stand_in() -> None:
    for name in ("flashinfer.mla", "flashinfer"):
        sys.modules.pop(name, None)
    WRAPPERS.clear()
