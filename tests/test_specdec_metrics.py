"""Speculative-decoding counters (engine stats, /metrics, bench throughput) and the start-up
errors for bad speculative options."""

from __future__ import annotations

import re

import pytest

from hitchllm import LLM, SamplingParams, default_model_path
from hitchllm.config import EngineConfig
from hitchllm.engine.llm_engine import EngineStats
from hitchllm.entrypoints.bench_throughput import spec_decode_summary
from hitchllm.entrypoints.cli import main

NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 3}
# Repetitive code: ngram drafts are often right.
PROMPT = "def f(self):\n    self.a = 1\n    self.b = 2\n    self.a = 1\n    self.b = 2\n"


def test_counters_add_up_to_the_tokens_emitted():
    """Batch 1, no stop: every step emits one sampled token plus the drafts it accepted, so
    output tokens = steps + accepted; the drafts per step never exceed K."""
    llm = LLM(default_model_path(), dtype="float32", **NGRAM)
    engine = llm.engine
    engine.add_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True))
    steps, tokens = 0, []
    while engine.has_unfinished_requests():
        steps += 1
        for out in engine.step():
            tokens = out.outputs[0].token_ids
    stats = engine.stats()
    assert len(tokens) == 60
    assert len(tokens) == steps + stats.spec_decode_num_accepted_tokens
    assert 0 < stats.spec_decode_num_accepted_tokens <= stats.spec_decode_num_draft_tokens
    assert stats.spec_decode_num_draft_tokens <= 3 * stats.spec_decode_num_drafts
    # Every step after the prefill's had drafts or not; a draft step is one of them.
    assert stats.spec_decode_num_drafts <= steps - 1


def test_counters_stay_zero_without_speculation():
    llm = LLM(default_model_path())
    llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)
    stats = llm.engine.stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens) == (0, 0, 0)


def metric(text: str, name: str) -> float:
    match = re.search(rf"^hitchllm:{name}_total\{{model_name=\"m\"\}} (\S+)$", text, re.M)
    assert match, f"{name} not exported"
    return float(match.group(1))


def test_metrics_export_the_engines_counters():
    pytest.importorskip("prometheus_client")
    from hitchllm.entrypoints.openai.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    names = ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
             "spec_decode_num_accepted_tokens")
    assert all(metric(metrics.render().decode(), n) == 0 for n in names)
    llm = LLM(default_model_path(), **NGRAM)
    params = SamplingParams(temperature=0.0, max_tokens=24)
    for _ in range(2):  # counters add what the engine counted since the last observation
        llm.generate(PROMPT, params, use_tqdm=False)
        metrics.observe(llm.engine, [], now=0.0)
        stats = llm.engine.stats()
        text = metrics.render().decode()
        assert metric(text, names[0]) == stats.spec_decode_num_drafts > 0
        assert metric(text, names[1]) == stats.spec_decode_num_draft_tokens
        assert metric(text, names[2]) == stats.spec_decode_num_accepted_tokens > 0


def stats(drafts: int, draft_tokens: int, accepted: int) -> EngineStats:
    return EngineStats(0, 0, 0.0, 0, 0, 0, drafts, draft_tokens, accepted)


def test_bench_summary_reports_rates_between_snapshots():
    line = spec_decode_summary(stats(2, 6, 3), stats(12, 36, 18))
    # 10 drafts of 30 tokens, 15 accepted: half; 1 + 1.5 tokens per step; 3 drafted.
    assert line.startswith("spec_decode: acceptance_rate=0.500 mean_accepted_length=2.50 "
                           "draft_tokens_per_step=3.00")
    assert spec_decode_summary(stats(2, 6, 3), stats(2, 6, 3)) is None


def test_bench_throughput_prints_the_spec_decode_summary(capsys):
    # Random prompts, but the bundled model soon repeats itself, which ngram drafts.
    args = ["bench", "throughput", "--num-prompts", "2", "--input-len", "16", "16",
            "--output-len", "96", "96", "--no-progress", "--speculative-method", "ngram",
            "--num-speculative-tokens", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    match = re.search(r"spec_decode: acceptance_rate=(\S+) mean_accepted_length=(\S+)", out)
    assert match, out
    assert 0 < float(match.group(1)) <= 1 and 1 < float(match.group(2)) <= 4


# ---- bad input: clear errors at start-up ----------------------------------------------


@pytest.mark.parametrize(("options", "message"), [
    ({"num_speculative_tokens": 0},
     r"speculative_method is set but num_speculative_tokens is 0; set it to the number of "
     r"draft tokens per step"),
    ({"num_speculative_tokens": -2},
     r"num_speculative_tokens: Input should be greater than or equal to 0 \(got -2\)"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(5\) is above prompt_lookup_max \(2\)"),
    ({"num_speculative_tokens": 3, "prompt_lookup_min": 0},
     r"prompt_lookup_min: Input should be greater than or equal to 1"),
])
def test_bad_speculative_options_are_explained(llama_path, options, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model=llama_path, speculative_method="ngram", **options)


def test_drafts_without_a_method_are_refused(llama_path):
    with pytest.raises(ValueError, match=r"num_speculative_tokens is 3 but no "
                                         r"speculative_method is set"):
        EngineConfig(model=llama_path, num_speculative_tokens=3)


def test_ngram_refuses_a_speculative_model(llama_path):
    with pytest.raises(ValueError, match=r"the ngram proposer drafts from the request's own "
                                         r"context and loads no model; drop speculative_model"):
        LLM(llama_path, speculative_method="ngram", num_speculative_tokens=2,
            speculative_model=llama_path)


def test_unknown_method_lists_the_installed_ones(llama_path):
    with pytest.raises(ValueError, match=r"'medusa' is not provided.*installed: .*ngram"):
        LLM(llama_path, speculative_method="medusa", num_speculative_tokens=2)


def test_cli_reports_bad_speculative_options_without_a_traceback(llama_path, capsys):
    code = main(["generate", "--model", llama_path, "--prompt", "x",
                 "--speculative-method", "ngram"])
    assert code == 2
    assert "error: speculative_method is set but num_speculative_tokens is 0" in (
        capsys.readouterr().err)
