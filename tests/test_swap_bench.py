"""benchmarks/preemption.py runs on the CPU with a tiny model: both modes produce the same
tokens, swap really swaps and computes fewer tokens, and the table lands in --results."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH_DIR))
    spec = importlib.util.spec_from_file_location("preemption_bench", BENCH_DIR / "preemption.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "preemption_bench", module)
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_run_compares_modes_and_appends(bench, tmp_path, capsys):
    results = tmp_path / "RESULTS.md"
    recompute, swap = bench.main([
        "--modes", "recompute", "swap", "--num-prompts", "4", "--prompt-len", "24",
        "--output-len", "24", "--block-size", "4", "--kv-fraction", "0.4",
        "--swap-space", "0.01", "--results", str(results)])
    assert recompute.outputs == swap.outputs
    assert all(len(t) == 24 for t in swap.outputs)
    assert recompute.preemptions > 0 and swap.swap_outs > 0 and recompute.swap_outs == 0
    assert swap.computed_tokens < recompute.computed_tokens
    assert swap.blocks_copied > 0 and recompute.blocks_copied == 0
    assert swap.percentile(0.99) >= swap.percentile(0.5) > 0
    assert "| swap |" in capsys.readouterr().out
    text = results.read_text()
    assert text.count(bench.SECTION) == 1 and "| recompute |" in text
    assert str(results) not in text  # the recorded command leaves --results out
