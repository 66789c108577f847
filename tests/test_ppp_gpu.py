"""Pipeline stages with decode CUDA graphs on 2 GPUs: each stage replays graphs of its layers
(the NCCL transfers run around the replays), and PP=2 generates the greedy tokens of one GPU
(fp32), with graphs and without; the step timeline shows graph replays on both stages and the
stages' answers leaving without waiting for the next launch. Run on the GPU machine with 2
cards; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from test_models_hf_parity import mixed_prompts
from test_tp_gpu import SHAPES, greedy_tokens, one_gpu_tokens
from tp_support import tp_llm

from hitchllm import timeline
from hitchllm.tiny_model import build_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

ENGINE = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256)


def test_pp2_stage_graphs_generate_what_one_gpu_generates(tmp_path, monkeypatch, auto_backend):
    path = str(build_tiny_checkpoint(tmp_path / "llama", "LlamaForCausalLM",
                                     **SHAPES["LlamaForCausalLM"]))
    prompts = mixed_prompts(3) + mixed_prompts(4)
    expected = one_gpu_tokens(path, prompts, **ENGINE)
    monkeypatch.setenv(timeline.ENV_VAR, "1")  # the workers keep their marks
    monkeypatch.setattr(timeline, "ACTIVE", None)  # and this process stops keeping its own after
    with tp_llm(path, pipeline_parallel_size=2, **ENGINE) as llm:
        assert greedy_tokens(llm, prompts) == expected
        marks = llm.engine.executor.timeline_marks()
    for stage in marks:
        assert sum(m.what == "graph_replay" for m in stage) > 10  # decode steps
    # The last stage's answers leave once a step is done, not after the next launch.
    last = timeline.summarize_stage("stage 1", marks[1], wall_s=1.0)
    assert last.answer_lag_ms < 50
    with tp_llm(path, pipeline_parallel_size=2, enforce_eager=True, **ENGINE) as llm:
        assert greedy_tokens(llm, prompts) == expected
