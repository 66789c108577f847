"""`hitchllm bench throughput` runs the workload on both engines and reports their ratio."""

from __future__ import annotations

import re

from hitchllm.entrypoints.cli import main


def test_bench_throughput_compares_with_hf(llama_path, capsys, tmp_path):
    results = tmp_path / "RESULTS.md"
    assert main(["bench", "throughput", "--model", llama_path, "--num-prompts", "4",
                 "--input-len", "4", "16", "--output-len", "2", "6", "--compare-hf",
                 "--hf-batch-size", "2", "--append-results", str(results)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| hitchllm")
            or line.startswith("| HF generate")]
    assert len(rows) == 2
    # Both engines produced the same number of useful output tokens.
    assert rows[0].split("|")[4] == rows[1].split("|")[4]
    assert re.search(r"^ratio_vs_hf=\d+\.\d\d$", out, re.MULTILINE)
    assert "ratio_vs_hf=" in results.read_text()
