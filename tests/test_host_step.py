"""Host work per step that no longer grows with the batch: sampling metadata reused while the
same requests sample in the same rows, decode rows' tokens copied into the input batch in one
assignment, and the benchmark that measures host time per step. Tokens must not change:
greedy tokens equal transformers', seeded and mixed batches equal a run that rebuilds the
metadata every step."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import hf_model

from hitchllm import LLM, SamplingParams
from hitchllm.engine import model_runner
from hitchllm.engine.input_batch import InputBatch
from hitchllm.engine.sampling_metadata import SamplingMetadata
from hitchllm.scheduler.step_plan import NewRequestData

ARCH = "LlamaForCausalLM"


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 20))] for _ in range(n)]


def _count_builds(monkeypatch) -> list[int]:
    """Count the runner's calls of ``build_sampling_metadata``."""
    calls: list[int] = []
    original = model_runner.build_sampling_metadata

    def counted(**kwargs):
        calls.append(len(kwargs["params"]))
        return original(**kwargs)

    monkeypatch.setattr(model_runner, "build_sampling_metadata", counted)
    return calls


def _hf_greedy_ignore_eos(path: str, prompt: list[int], n: int) -> list[int]:
    """Plain argmax continuation (EOS is a token like any other, as under ignore_eos)."""
    model = hf_model(path)
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reused_metadata_greedy_tokens_match_transformers(tiny_models, monkeypatch,
                                                          async_scheduling):
    """Seven requests through four rows with different lengths: rows join and leave while
    others decode, and between those changes the metadata is reused, not rebuilt."""
    path = tiny_models[ARCH]
    builds = _count_builds(monkeypatch)
    llm = LLM(path, block_size=4, max_num_seqs=4, async_scheduling=async_scheduling)
    prompts = _prompts(7)
    lengths = [12, 5, 16, 9, 14, 3, 11]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, n, out in zip(prompts, lengths, outs, strict=True):
        assert out.outputs[0].token_ids == _hf_greedy_ignore_eos(path, prompt, n)
    steps = llm.engine.executor.runner.num_steps
    # Every sampling step would build without reuse; the batch changes at most once per
    # request joining and once per request leaving.
    assert len(builds) <= min(2 * len(prompts), steps // 2), (len(builds), steps)


MIXED = [
    SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True),
    SamplingParams(temperature=0.9, top_k=20, max_tokens=18, seed=7, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.8, max_tokens=9, seed=11, ignore_eos=True),
    # Not reusable while it is under min_tokens, then reusable.
    SamplingParams(temperature=0.7, max_tokens=16, min_tokens=6, seed=3),
    SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.8, min_p=0.1, max_tokens=20, seed=5, ignore_eos=True),
    # Penalties depend on the output: never reused while it runs.
    SamplingParams(temperature=0.6, max_tokens=7, seed=9, repetition_penalty=1.3,
                   ignore_eos=True),
    SamplingParams(temperature=0.0, max_tokens=15, ignore_eos=True),
]


def _run_mixed(path: str, async_scheduling: bool):
    llm = LLM(path, block_size=4, max_num_seqs=5, async_scheduling=async_scheduling, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(len(MIXED), seed=2)],
                        MIXED, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reused_metadata_seeded_and_mixed_tokens_match_rebuilding_every_step(
        tiny_models, monkeypatch, async_scheduling):
    path = tiny_models[ARCH]
    with monkeypatch.context() as m:
        m.setattr(SamplingMetadata, "reusable", property(lambda self: False))
        builds = _count_builds(m)
        rebuilt = _run_mixed(path, async_scheduling)
        num_rebuilt = len(builds)
    builds = _count_builds(monkeypatch)
    assert _run_mixed(path, async_scheduling) == rebuilt
    assert len(builds) < num_rebuilt  # the reusing run did reuse


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["TRITON_ATTN", "TORCH"])
def test_cuda_graph_and_async_steps_with_reused_metadata_match_rebuilding(
        tiny_models, monkeypatch, backend):
    """On CUDA (async scheduling with the pending-token gather; decode graphs with
    TRITON_ATTN) reusing the metadata's device tensors gives the tokens of rebuilding them."""
    path = tiny_models[ARCH]

    def run(m):
        builds = _count_builds(m)
        llm = LLM(path, device="cuda", max_num_seqs=5, attention_backend=backend, seed=1)
        runner = llm.engine.executor.runner
        if backend == "TRITON_ATTN":
            assert runner.graphs is not None and runner.graphs.captured
        outs = llm.generate([{"prompt_token_ids": p} for p in _prompts(len(MIXED), seed=2)],
                            MIXED, use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs], builds

    with monkeypatch.context() as m:
        m.setattr(SamplingMetadata, "reusable", property(lambda self: False))
        rebuilt, rebuilt_builds = run(m)
    reused, reused_builds = run(monkeypatch)
    assert reused == rebuilt
    assert len(reused_builds) < len(rebuilt_builds)


def _state(batch: InputBatch, rid: str, prompt: list[int], params=None):
    return batch.add(NewRequestData(rid, prompt, params or SamplingParams()), [])


def test_metadata_is_rebuilt_when_rows_drafts_or_outputs_matter(tiny_models):
    runner = LLM(tiny_models[ARCH], block_size=4).engine.executor.runner
    batch = InputBatch(8, 64, 16)
    random_params = SamplingParams(temperature=0.8, top_k=5, seed=1)
    a = _state(batch, "a", [5, 6, 7], random_params)
    b = _state(batch, "b", [8, 9], SamplingParams(temperature=0.0))
    first = runner._sampling_metadata([(a, []), (b, [])], {}, 2)
    again = runner._sampling_metadata([(a, []), (b, [])], {}, 2)
    assert again is not first and again.temperature is first.temperature
    assert again.generators == first.generators
    swapped = runner._sampling_metadata([(b, []), (a, [])], {}, 2)
    assert swapped.temperature is not first.temperature
    assert swapped.temperature.tolist() == [0.0, pytest.approx(0.8)]
    # The same rows with a draft: two logits rows for ``a``, drafts to verify.
    drafted = runner._sampling_metadata([(b, []), (a, [42])], {}, 3)
    assert drafted.drafts is not None and len(drafted.temperature) == 3
    # A row under min_tokens forbids its stop token until it has enough output.
    c = _state(batch, "c", [1, 2], SamplingParams(temperature=0.0, min_tokens=2,
                                                  stop_token_ids=[17]))
    under = runner._sampling_metadata([(c, [])], {}, 1)
    assert under.stop_token_mask_rows is not None
    assert runner._sampling_metadata([(c, [])], {}, 1) is not under
    c.append_tokens([3, 4])
    past = runner._sampling_metadata([(c, [])], {}, 1)
    assert past.stop_token_mask_rows is None
    assert runner._sampling_metadata([(c, [])], {}, 1).temperature is past.temperature
    # Penalties count the output so far: rebuilt every step.
    d = _state(batch, "d", [1, 2], SamplingParams(temperature=0.0, presence_penalty=0.5))
    pen = runner._sampling_metadata([(d, [])], {}, 1)
    d.append_tokens([9])
    pen2 = runner._sampling_metadata([(d, [])], {}, 1)
    assert pen2.output_token_ids is not pen.output_token_ids
    assert 9 in pen2.output_token_ids.tolist()[0]


def test_sync_rows_matches_syncing_each_request():
    """A random run of requests joining, decoding (one token, several, none), drafting and
    growing blocks: ``sync_rows`` leaves the token and block tables as ``sync`` of each."""
    rng = random.Random(0)
    fast, ref = InputBatch(6, 80, 20), InputBatch(6, 80, 20)
    live: list[str] = []
    counter = 0
    for _ in range(60):
        if len(live) < 6 and rng.random() < 0.3:
            rid = f"r{counter}"
            counter += 1
            prompt = [rng.randrange(1000) for _ in range(rng.randrange(1, 10))]
            output = [rng.randrange(1000) for _ in range(rng.choice([0, 0, 3]))]
            for b in (fast, ref):
                b.add(NewRequestData(rid, prompt, SamplingParams(), (),
                                     list(output)), [])
            live.append(rid)
        if live and rng.random() < 0.15:
            gone = live.pop(rng.randrange(len(live)))
            fast.release(gone)
            ref.release(gone)
        ids = rng.sample(live, len(live))
        blocks = [[rng.randrange(100) for _ in range(rng.choice([0, 0, 0, 1, 2]))]
                  for _ in ids]
        drafts = {rid: [rng.randrange(1000) for _ in range(2)]
                  for rid in ids if rng.random() < 0.2}
        states, got_drafts, rows, known = fast.sync_rows(ids, blocks, drafts)
        assert [s.request_id for s in states] == ids
        assert got_drafts == [drafts.get(rid, []) for rid in ids]
        expected_rows = [ref.sync(ref.states[rid], bl, drafts.get(rid, []))
                         for rid, bl in zip(ids, blocks)]
        assert rows.tolist() == expected_rows
        assert known.tolist() == [ref.states[rid].num_tokens + len(drafts.get(rid, []))
                                  for rid in ids]
        for rid in ids:
            row = fast.states[rid].row
            n = fast.states[rid].num_tokens + len(drafts.get(rid, []))
            assert np.array_equal(fast.token_ids[row, :n], ref.token_ids[row, :n])
            nb = fast.states[rid].num_blocks
            assert nb == ref.states[rid].num_blocks
            assert np.array_equal(fast.block_table[row, :nb], ref.block_table[row, :nb])
        for rid in live:  # decoding: 0, 1 or 3 new tokens each
            new = [rng.randrange(1000) for _ in range(rng.choice([0, 1, 1, 1, 3]))]
            fast.states[rid].append_tokens(new)
            ref.states[rid].append_tokens(new)


def test_host_step_benchmark_reports_every_phase(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks"))
    import host_step

    results = tmp_path / "RESULTS.md"
    monkeypatch.setattr(sys, "argv", ["host_step.py", "--batch-size", "2", "6", "--steps", "4",
                                      "--rounds", "2", "--vocab-size", "600", "--generate",
                                      "3", "--results", str(results)])
    host_step.main()
    text = results.read_text()
    assert "## Host time per step" in text and "| schedule | prepare inputs |" in text
    rows = [line for line in text.splitlines() if line.startswith(("| 2 |", "| 6 |"))][:2]
    for row in rows:
        cells = [float(c.replace(",", "")) for c in row.strip("|").split("|")]
        step_ms, phases = cells[1], cells[2:2 + len(host_step.PHASES)]
        assert step_ms > 0 and all(p >= 0 for p in phases)
        assert sum(phases) == pytest.approx(step_ms, abs=0.01)
        assert cells[-1] > 0  # Python calls per step
    assert "| output tok/s | process CPU s |" in text
    generated = [line for line in text.splitlines()[-3:] if line.startswith("| ")]
    assert [line.split("|")[1].strip() for line in generated] == ["2", "6"]
