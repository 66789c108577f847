"""Swap preemption on CUDA (run on the GPU machine; skipped elsewhere): copies on the side
stream into pinned host memory, with and without CUDA graphs and async scheduling, give the
greedy tokens of the unpreempted engine; the pools are whole at the end."""

from __future__ import annotations

import pytest
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams

pytestmark = pytest.mark.gpu

SWAP = dict(block_size=4, num_kv_blocks=24, preemption_mode="swap", swap_space=0.05)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


# float32 (as the other CUDA preemption tests): bfloat16 GEMMs may round differently in the
# different batches a preempted run forms, which would flip greedy ties for another reason.
@pytest.mark.parametrize("backend", ["TORCH", "TRITON_ATTN"])
@pytest.mark.parametrize("eager,async_scheduling", [(False, True), (True, False)])
def test_cuda_swap_keeps_greedy_tokens(tiny_models, backend, eager, async_scheduling):
    path = tiny_models["Qwen3ForCausalLM"]
    prompts = mixed_prompts(3)
    common = dict(device="cuda", dtype="float32", attention_backend=backend, enforce_eager=eager,
                  async_scheduling=async_scheduling)
    try:
        expected = generate(LLM(path, block_size=4, **common), prompts)
    except ValueError as exc:  # a backend this card or install does not serve
        pytest.skip(str(exc))
    llm = LLM(path, **SWAP, **common)
    assert llm.engine.kv_cache.host is not None
    assert llm.engine.executor.runner.host_kv.host_caches[0].is_pinned()
    assert generate(llm, prompts) == expected
    stats = llm.engine.stats()
    assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
    kv = llm.engine.kv_cache
    assert kv.num_free_blocks == kv.num_blocks and kv.num_free_host_blocks == kv.num_host_blocks
