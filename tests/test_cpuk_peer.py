"""benchmarks/cpu_peer.py: per-round ratios, the table, and clear errors when the peer set-up
is missing (the runs themselves need vLLM's CPU build and take minutes: not run here)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "cpu_peer.py"


@pytest.fixture(scope="module")
def cpu_peer():
    spec = importlib.util.spec_from_file_location("cpu_peer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record(label, rnd, tok_s, model="llama-256x4", dtype="float32", load=1.0):
    return {"label": label, "round": rnd, "model": model, "dtype": dtype,
            "out_tok_s": tok_s, "loadavg": [load, 0.0, 0.0]}


def test_ratios_are_taken_within_each_round_then_the_median(cpu_peer):
    # Round 2 runs on a machine twice as busy: every engine halves; the ratio must not move.
    records = [_record("hitchllm", 1, 1200.0), _record("vllm", 1, 1000.0),
               _record("hf", 1, 300.0, load=2.5),
               _record("hitchllm", 2, 600.0), _record("vllm", 2, 500.0),
               _record("hf", 2, 150.0),
               _record("hitchllm", 3, 1100.0), _record("vllm", 3, 1000.0),
               _record("hf", 3, 200.0)]
    rows = cpu_peer.summarize(records, ["hitchllm", "vllm", "hf"])
    assert rows[0].startswith("| model | dtype | rounds | hitchllm tok/s | vllm tok/s")
    line = rows[2]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:3] == ["llama-256x4", "float32", "3"]
    assert cells[3] == "1,100"  # median of 1200, 600, 1100
    assert cells[6] == "**1.20x** (1.20, 1.20, 1.10)"  # hitchllm / vllm per round
    assert cells[7] == "**4.00x** (4.00, 4.00, 5.50)"  # hitchllm / hf
    assert cells[8] == "1.0-2.5"


def test_failed_runs_and_missing_peers_are_left_out(cpu_peer):
    records = [_record("hitchllm", 1, 900.0, dtype="bfloat16"),
               dict(_record("vllm", 1, 1000.0, dtype="bfloat16"), error="expected 10, got 9"),
               _record("hitchllm", 1, 100.0, model="default_model")]
    rows = cpu_peer.summarize(records, ["hitchllm", "vllm"])
    by_model = {r.split("|")[1].strip() + "/" + r.split("|")[2].strip(): r for r in rows[2:]}
    assert set(by_model) == {"llama-256x4/bfloat16", "default_model/float32"}
    assert "| 900 | - | - |" in by_model["llama-256x4/bfloat16"]


def test_cpu_description_names_the_model_and_vector_flags(cpu_peer):
    text = cpu_peer.cpu_description()
    assert "cores, flags:" in text
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if " avx2" in flags:
        assert "avx2" in text.split("flags:")[1]


def test_a_missing_harness_or_environment_is_a_clear_error(tmp_path):
    run = subprocess.run([sys.executable, str(SCRIPT), "--harness", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "no peer harness at" in run.stderr
    (tmp_path / "interleave.py").write_text("")
    run = subprocess.run([sys.executable, str(SCRIPT), "--harness", str(tmp_path),
                          "--peer-dir", str(tmp_path / "nowhere")],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode != 0 and "venv-hitch" in run.stderr and "README.md" in run.stderr


def test_the_entry_names_the_peer_folder_peer_dir(tmp_path):
    """A RESULTS.md entry is read on other machines: the peer folder given on this one is
    written as PEER_DIR, the rest of the command as given."""
    import json

    jsonl = tmp_path / "run.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in (
        _record("hitchllm", 1, 1200.0), _record("vllm", 1, 1000.0))) + "\n")
    results = tmp_path / "RESULTS.md"
    run = subprocess.run([sys.executable, str(SCRIPT), "--peer-dir", str(tmp_path / "peer"),
                          "--from-jsonl", str(jsonl), "--configs", "hitchllm,vllm",
                          "--results", str(results)],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    text = results.read_text()
    assert "--peer-dir PEER_DIR --from-jsonl" in text and str(tmp_path / "peer") not in text
    assert "**1.20x**" in text
