"""``benchmarks/mla_decode.py``: the CPU smoke run (tiny dims through Triton's interpreter)
checks TRITON_MLA against the float64 reference, prints and appends its table; a wrong kernel
output stops the run before any timing."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
pytest.importorskip("hitchllm_attention_mla")

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location("mla_decode_bench", BENCH_DIR / "mla_decode.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mla_decode_bench", module)
    spec.loader.exec_module(module)
    return module


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
    monkeypatch.setattr(bench, "time_us", lambda *a: pytest.fail("timed a wrong kernel"))
    with pytest.raises(AssertionError, match="relative error"):
        bench.main(["--device", "cpu"])
