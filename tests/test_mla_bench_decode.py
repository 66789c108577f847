"""``benchmarks/mla_decode.py``: the CPU smoke run (tiny dims through Triton's interpreter)
checks TRITON_MLA against the float64 reference, prints and appends its table; a wrong kernel
output stops the run before any timing; the FlashInfer column's page lists (from the block
table) give the reference through a torch stand-in of FlashInfer's MLA wrapper."""

from __future__ import annotations

import sys

import pytest
import torch
from bench_support import load_benchmark

pytest.importorskip("triton")
pytest.importorskip("hitchllm_attention_mla")

@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "mla_decode.py")


def test_cpu_smoke_run_checks_prints_and_appends(bench, tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    rows = bench.main(["--device", "cpu", "--results", str(results)])
    assert len(rows) == len(bench.CPU_DIMS.cases)
    printed = capsys.readouterr().out
    assert all(row in printed for row in rows)
    text = results.read_text()
    assert text.count(bench.SECTION) == 1 and "TRITON_MLA GB/s" in text
    # FlashInfer is GPU-only: its columns say why they are empty.
    assert all(("not installed" in row) or ("GPU only" in row) for row in rows)
    bench.main(["--device", "cpu", "--results", str(results)])
    assert results.read_text().count(bench.SECTION) == 1  # the section heading once


def test_bytes_count_latents_once_per_request_plus_queries_and_outputs(bench):
    dims = bench.CPU_DIMS
    case = bench.make_case(dims, requests=3, context=20, page=4, device=torch.device("cpu"))
    width, rank, heads = dims.width, dims.kv_lora_rank, dims.heads
    assert bench.useful_bytes(case, rank) == 4 * (3 * 20 * width + 3 * heads * width
                                                   + 3 * heads * rank)


def test_a_wrong_output_stops_the_run_before_timing(bench, monkeypatch):
    def wrong(case, rank):
        return lambda: bench.reference(case, rank).float() * 1.01

    monkeypatch.setattr(bench, "triton_fn", wrong)
    monkeypatch.setattr(bench, "device_time_us", lambda *a: pytest.fail("timed a wrong kernel"))
    with pytest.raises(AssertionError, match="relative error"):
        bench.main(["--device", "cpu"])


class FakeMLAWrapper:
    """FlashInfer's MLA wrapper interface, computed in torch from the page lists it is
    planned with (CSR: ``kv_indptr`` into ``kv_indices``), so the benchmark's conversion of
    a block table to page lists is checked on the CPU."""

    def __init__(self, workspace, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None):
        self.buffers = (qo_indptr, kv_indptr, kv_indices, kv_len_arr)

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv,
             head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type):
        for buffer, value in zip(self.buffers, (qo_indptr, kv_indptr, kv_indices, kv_len_arr)):
            assert buffer.shape == value.shape and buffer.dtype == torch.int32
        self.plan_args = kv_indptr, kv_indices, kv_len_arr, sm_scale, head_dim_ckv, page_size
        assert not causal and num_heads == 4 and head_dim_kpe == 8

    def run(self, q_nope, q_pe, ckv_cache, kpe_cache):
        kv_indptr, kv_indices, kv_lens, scale, rank, page = self.plan_args
        assert ckv_cache.shape[1] == page and ckv_cache.shape[-1] == rank
        out = []
        for i in range(len(kv_lens)):
            pages = kv_indices[kv_indptr[i]:kv_indptr[i + 1]].long()
            n = int(kv_lens[i])
            c = ckv_cache[pages].flatten(0, 1)[:n].double()
            r = kpe_cache[pages].flatten(0, 1)[:n].double()
            probs = ((q_nope[i].double() @ c.T + q_pe[i].double() @ r.T) * scale).softmax(-1)
            out.append(probs @ c)
        return torch.stack(out).to(q_nope.dtype)


def test_flashinfer_column_gets_the_requests_page_lists(bench, monkeypatch):
    fake = type(sys)("flashinfer")
    fake.mla = type(sys)("flashinfer.mla")
    fake.mla.BatchMLAPagedAttentionWrapper = FakeMLAWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    dims = bench.CPU_DIMS
    case = bench.make_case(dims, requests=3, context=18, page=4, device=torch.device("cpu"))
    case.seq_lens = torch.tensor([18, 1, 9], dtype=torch.int32)  # fewer pages than columns
    want = bench.reference(case, dims.kv_lora_rank)
    assert bench.check(bench.flashinfer_fn(case, dims.kv_lora_rank), want, 1e-6) < 1e-6
    case.block_table[1, 0] = case.block_table[0, 0]  # another page: another result
    with pytest.raises(AssertionError, match="relative error"):
        bench.check(bench.flashinfer_fn(case, dims.kv_lora_rank), want, 1e-6)
