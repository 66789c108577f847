"""benchmarks/run_breakdown.py and benchmarks/peer_gpu.py on the CPU: the whole-run step table
accounts for every step and output token of a real engine run, the bandwidth floor is worked
out by hand, and the peer driver runs hitchllm variants on the peer's workload (a stand-in
peer folder) and reports best-of-rounds ratios."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from bench_support import BENCH_DIR, load_benchmark

from hitchllm import LLM, SamplingParams, timeline


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory) -> Path:
    """A tiny random Qwen3 whose vocabulary covers the workload's token ids (0-10000)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from hitchllm.tiny_model import build_tokenizer

    path = tmp_path_factory.mktemp("qwen")
    config = Qwen3Config(vocab_size=10240, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=4096)
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    build_tokenizer(10240).save_pretrained(path)
    return path


def test_workload_is_nano_vllms(monkeypatch):
    rb = load_benchmark(monkeypatch, "run_breakdown.py")
    prompts, max_tokens = rb.nano_workload()
    # bench.py's totals (../shared/peer/README.md): 142,827 prompt and 133,966 output tokens.
    assert (len(prompts), sum(map(len, prompts)), sum(max_tokens)) == (256, 142827, 133966)
    assert rb.nano_workload(3) == (prompts[:3], max_tokens[:3])


def test_step_table_accounts_for_the_whole_run(monkeypatch, qwen_path):
    rb = load_benchmark(monkeypatch, "run_breakdown.py")
    monkeypatch.setenv(timeline.ENV_VAR, "1")
    monkeypatch.setattr(timeline, "ACTIVE", None)
    prompts, _ = rb.nano_workload(6)
    max_tokens = [3, 40, 7, 25, 12, 60]
    llm = LLM(str(qwen_path), device="cpu", dtype="float32", block_size=16,
              max_num_batched_tokens=1024, max_model_len=4096)
    timeline.drain()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
                            for n in max_tokens], use_tqdm=False)
    steps = rb.read_steps(timeline.drain())
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(max_tokens)
    # Every prompt token is computed in some step; every output token but each request's
    # first (sampled at the end of its prompt) comes from a decode row.
    assert sum(s.tokens - s.decodes for s in steps) == sum(map(len, prompts))
    assert sum(s.decodes for s in steps) == produced - len(prompts)
    assert {s.group for s in steps} >= {"prompt only", "decode 1-15"}
    assert all(s.device_s >= 0 and s.idle_s >= 0 for s in steps)
    table = rb.group_table(steps, wall=sum(s.device_s + s.idle_s for s in steps))
    total = next(row for row in table if row.startswith("| all steps"))
    assert f"| {len(steps)} |" in total and f"| {produced - len(prompts):,} |" in total


def test_floor_is_kv_and_weight_bytes_over_bandwidth(monkeypatch):
    rb = load_benchmark(monkeypatch, "run_breakdown.py")
    mc = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=3, head_dim=4)
    weights = torch.nn.Linear(10, 10, bias=False).to(torch.bfloat16)  # 200 bytes
    engine = SimpleNamespace(model_config=mc, kv_cache_dtype=torch.bfloat16,
                             executor=SimpleNamespace(worker=SimpleNamespace(model=weights)))
    # prompt 5, 3 tokens: decodes read 5 + 1, 5 + 2; prompt 2, 1 token: no decode.
    line, = rb.floor_lines(SimpleNamespace(engine=engine), [[0] * 5, [0] * 2], [3, 1],
                           wall=1.0, produced=4, bandwidth=1000.0)
    kv_bytes = (6 + 7) * 2 * 2 * 3 * 4 * 2
    seconds = kv_bytes / 1000 + 200 * 3 / 1000
    assert f"= {seconds:.2f} s, {4 / seconds:,.0f} output tok/s" in line


def test_peer_driver_runs_variants_on_the_peers_workload(tmp_path, qwen_path):
    peer = tmp_path / "peer"
    peer.mkdir()
    (peer / "bench_pair.py").write_text(
        "def make_workload():\n"
        "    return [[5, 6, 7] * 7, [9, 8] * 11], [4, 6]\n"
        "def fingerprint(prompts, max_tokens):\n"
        "    return 'stand-in'\n"
        "if __name__ == '__main__':\n"
        "    print('RESULT engine=nanovllm output_tokens=10 seconds=2.000 output_tok_s=5.0 '\n"
        "          'ok=true workload=stand-in setup_s=1.0')\n")
    results = tmp_path / "RESULTS.md"
    out = subprocess.run(
        [sys.executable, str(BENCH_DIR / "peer_gpu.py"), "--model", str(qwen_path), "--peer",
         str(peer), "--rounds", "2", "--variant", "default", "--variant", "eager",
         "enforce_eager=True", "--warm-pass", "--append-results", "--results", str(results)],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    runs = [line for line in out.stdout.splitlines() if line.startswith("round ")]
    assert [r.split(":")[0] for r in runs] == [f"round {r} {n}" for r in (1, 2)
                                                for n in ("default", "eager", "nano-vllm")]
    assert all("10 tokens" in r and "ok=true" in r and "stand-in" in r for r in runs)
    text = results.read_text()
    assert "--variant eager enforce_eager=True" in text and "nano-vllm: best 5" in text
    assert "x nano-vllm's best" in text
    # Each hitchllm run: its start-up phases, what compiled in the timed generate, the warm
    # pass (a second generate of the workload in the same process).
    costs = [line for line in text.splitlines()
             if line.startswith(("| 1 | default", "| 2 | eager")) and "model" in line]
    assert len(costs) == 2, text
    assert all("KV cache sizing" in line and line.count("|") == 8 for line in costs), costs
    warm = [float(line.split("|")[6]) for line in costs]
    assert all(w > 0 for w in warm), costs
