"""Pipeline parallelism on 2 GPUs (NCCL point-to-point between the stages): PP=2 generates
what one GPU does, for Llama and Qwen3 shapes (3 layers: an uneven 2 + 1 split; Qwen3's tied
head loads its own copy of the embedding on stage 1); and TP=2 x PP=2 on 4 GPUs. Run on the
GPU machine with 2 (or 4) cards; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from test_models_hf_parity import mixed_prompts
from test_tp_gpu import SHAPES, greedy_tokens, models, one_gpu_tokens  # noqa: F401
from tp_support import tp_llm

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

ENGINE = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256)


@pytest.mark.parametrize("arch", list(SHAPES))
def test_pp2_matches_pp1_on_two_gpus(models, arch, auto_backend):  # noqa: F811
    path = models[arch]
    prompts = mixed_prompts(6)
    expected = one_gpu_tokens(path, prompts, **ENGINE)
    with tp_llm(path, pipeline_parallel_size=2, **ENGINE) as llm:
        assert greedy_tokens(llm, prompts) == expected


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs 4 GPUs")
def test_tp2_pp2_matches_one_gpu_on_four_gpus(models, auto_backend):  # noqa: F811
    path = models["LlamaForCausalLM"]
    prompts = mixed_prompts(6)
    expected = one_gpu_tokens(path, prompts, **ENGINE)
    with tp_llm(path, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE) as llm:
        assert greedy_tokens(llm, prompts) == expected
