"""Pipeline stages overlap on 2 GPUs (NCCL point-to-point): PP=2 keeps 2 micro-batches in
flight and generates the greedy tokens of PP=1 on a small Llama shape in fp32, with a batch
large enough that both micro-batches carry requests and with chunked prefill. Run on the GPU
machine with 2 cards; skipped elsewhere."""

from __future__ import annotations

import pytest
import torch
from test_models_hf_parity import mixed_prompts
from test_tp_gpu import SHAPES, greedy_tokens
from tp_support import tp_llm

from hitchllm import LLM
from hitchllm.tiny_model import build_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

# A 64-token budget chunks the 75- and 90-token prompts.
ENGINE = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256,
              max_num_batched_tokens=64)


def test_pp2_overlapping_micro_batches_match_pp1_on_two_gpus(tmp_path, auto_backend):
    path = str(build_tiny_checkpoint(tmp_path / "llama", "LlamaForCausalLM",
                                     **SHAPES["LlamaForCausalLM"]))
    prompts = mixed_prompts(7) + mixed_prompts(8, lengths=(2, 11, 33, 75, 90, 5))
    expected = greedy_tokens(LLM(path, **ENGINE), prompts)
    with tp_llm(path, pipeline_parallel_size=2, **ENGINE) as llm:
        assert greedy_tokens(llm, prompts) == expected
        assert llm.engine.stats().max_steps_in_flight == 2
        assert llm.engine.executor.max_unread_steps == 2
        assert llm.engine.kv_cache.num_free_blocks == llm.engine.num_kv_blocks
