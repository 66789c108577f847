"""Swap preemption with the special cache layouts, end to end on the CPU: an MLA model (one
latent vector per token, TORCH_MLA) and an fp8 KV cache (copied as bytes) give under heavy swap
preemption the greedy tokens of the same engine unpreempted."""

from __future__ import annotations

import pytest
from mla_checkpoints import build_tiny_deepseek
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams

SWAP = dict(block_size=4, num_kv_blocks=24, preemption_mode="swap", swap_space=0.01)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def deepseek_path(tmp_path_factory) -> str:
    return build_tiny_deepseek(tmp_path_factory.mktemp("v2-swap"), "DeepseekV2ForCausalLM")


def _check(path: str, **engine) -> None:
    prompts = mixed_prompts(5)
    expected = generate(LLM(path, block_size=4, **engine), prompts)
    llm = LLM(path, **SWAP, **engine)
    assert generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_swap_outs > 0 and stats.host_blocks_used == 0


def test_mla_latent_cache_swaps(deepseek_path):
    _check(deepseek_path, attention_backend="TORCH_MLA")


def test_fp8_cache_swaps(llama_path):
    _check(llama_path, kv_cache_dtype="fp8")
