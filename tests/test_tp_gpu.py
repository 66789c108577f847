"""Tensor parallelism on 2 GPUs (NCCL): TP=2 generates what TP=1 does, with the decode CUDA
graphs (which capture the all-reduce) and without them. Run on the GPU machine with 2 cards;
skipped elsewhere."""

from __future__ import annotations

import gc

import pytest
import torch
from test_models_hf_parity import mixed_prompts
from tp_support import tp_llm

from hitchllm import LLM, SamplingParams
from hitchllm.tiny_model import build_tiny_checkpoint

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs"),
]

MAX_TOKENS = 24
# Wider than the CPU tests' models, so the kernels are those of real shapes: 8 query heads
# split 4 + 4; Llama's 2 KV heads split, Qwen3's 1 KV head replicated; 515 vocabulary rows.
SHAPES = {
    "LlamaForCausalLM": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=2, num_hidden_layers=3),
    "Qwen3ForCausalLM": dict(hidden_size=256, intermediate_size=512, num_attention_heads=8,
                             num_key_value_heads=1, num_hidden_layers=3, head_dim=32,
                             vocab_size=515, tie_word_embeddings=True),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tp-gpu")
    return {arch: str(build_tiny_checkpoint(root / arch, arch, **shape))
            for arch, shape in SHAPES.items()}


def greedy_tokens(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_TOKENS):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def one_gpu_tokens(path: str, prompts: list[list[int]], max_tokens: int = MAX_TOKENS,
                   **engine) -> list[list[int]]:
    """Greedy tokens of a single-GPU engine in this process, whose KV cache is then handed
    back to the driver: left in PyTorch's cache it would starve rank 0 of the TP/PP engine
    started next on the same card."""
    with LLM(path, **engine) as llm:
        tokens = greedy_tokens(llm, prompts, max_tokens)
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return tokens


@pytest.mark.parametrize("arch", list(SHAPES))
def test_tp2_matches_tp1_on_two_gpus_with_and_without_cuda_graphs(models, arch,
                                                                  auto_backend):
    path = models[arch]
    prompts = mixed_prompts(6)  # a decode batch of 6: padded to a captured graph size
    engine = dict(device="cuda", dtype="float32", block_size=16, max_model_len=256)
    expected = one_gpu_tokens(path, prompts, **engine)
    with tp_llm(path, tensor_parallel_size=2, **engine) as llm:
        assert greedy_tokens(llm, prompts) == expected  # decode steps replay graphs
    with tp_llm(path, tensor_parallel_size=2, enforce_eager=True, **engine) as llm:
        assert greedy_tokens(llm, prompts) == expected


def test_tp2_bfloat16_tracks_tp1(models, auto_backend):
    """In bf16 the ranks' partial sums round differently from one card's full sums, so only
    the first tokens (before a near-tie can flip) are compared."""
    path = models["LlamaForCausalLM"]
    prompts = mixed_prompts(4)
    expected = one_gpu_tokens(path, prompts, 4, device="cuda", dtype="bfloat16")
    with tp_llm(path, device="cuda", dtype="bfloat16", tensor_parallel_size=2) as llm:
        got = greedy_tokens(llm, prompts, 4)
    assert [t[:2] for t in got] == [t[:2] for t in expected]
