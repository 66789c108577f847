"""benchmarks/preemption.py runs on the CPU with a tiny model: both modes produce the same
tokens, swap really swaps and computes fewer tokens, and the table lands in --results."""

from __future__ import annotations

import pytest
from bench_support import load_benchmark


@pytest.fixture
def bench(monkeypatch):
    return load_benchmark(monkeypatch, "preemption.py")


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
