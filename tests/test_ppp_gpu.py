"""Pipeline stages with decode CUDA graphs on 2 GPUs: each stage replays graphs of its layers
(the NCCL transfers run around the replays) and the stages' answers leave without waiting for
the next launch. Graphs need a backend that captures (TRITON_ATTN, so bfloat16: the TORCH
backend of the fp32 equality tests never captures); the graph run must give the tokens of the
same pipeline run eagerly (same micro-batches, same kernels), and the fp32 TORCH run at PP=2
the tokens of one GPU. Run on the GPU machine with 2 cards; skipped elsewhere."""

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

ENGINE = dict(device="cuda", block_size=16, max_model_len=256)


def test_pp2_stage_graphs_generate_what_eager_stages_and_one_gpu_generate(
        tmp_path, monkeypatch, auto_backend):
    path = str(build_tiny_checkpoint(tmp_path / "llama", "LlamaForCausalLM",
                                     **SHAPES["LlamaForCausalLM"]))
    prompts = mixed_prompts(3) + mixed_prompts(4)
    expected = one_gpu_tokens(path, prompts, dtype="float32", **ENGINE)
    with tp_llm(path, pipeline_parallel_size=2, dtype="float32", **ENGINE) as llm:
        assert greedy_tokens(llm, prompts) == expected
    graphs = dict(dtype="bfloat16", attention_backend="TRITON_ATTN", **ENGINE)
    with tp_llm(path, pipeline_parallel_size=2, enforce_eager=True, **graphs) as llm:
        eager = greedy_tokens(llm, prompts)
    monkeypatch.setenv(timeline.ENV_VAR, "1")  # the workers keep their marks
    monkeypatch.setattr(timeline, "ACTIVE", None)  # and this process stops keeping its own after
    with tp_llm(path, pipeline_parallel_size=2, **graphs) as llm:
        assert greedy_tokens(llm, prompts) == eager
        marks = llm.engine.executor.timeline_marks()
    for stage in marks:
        assert sum(m.what == "graph_replay" for m in stage) > 10  # decode steps
    # The last stage's answers leave once a step is done, not after the next launch.
    last = timeline.summarize_stage("stage 1", marks[1], wall_s=1.0)
    assert last.answer_lag_ms < 50
