"""The engine on CUDA with the TORCH backend (run on the GPU machine; skipped elsewhere)."""

from __future__ import annotations

import pytest
import torch
from reference import hf_greedy
from test_models_hf_parity import MAX_NEW, greedy, mixed_prompts, run

from hitchllm import LLM, SamplingParams
from hitchllm.tiny_model import ARCHITECTURES

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_cuda_float32_greedy_matches_transformers(tiny_models, arch):
    path = tiny_models[arch]
    prompts = mixed_prompts()
    llm = LLM(path, device="cuda", dtype="float32", block_size=16)
    assert run(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)


def test_cuda_bfloat16_tracks_transformers(tiny_models):
    path = tiny_models["Qwen3ForCausalLM"]
    prompts = mixed_prompts(4, lengths=(4, 21, 40))
    llm = LLM(path, device="cuda")
    assert llm.engine.dtype == torch.bfloat16
    ours = run(llm, prompts, max_tokens=4)
    ref = hf_greedy(path, prompts, 4, dtype=torch.bfloat16)
    assert [o[:2] for o in ours] == [r[:2] for r in ref]


def test_cuda_chunked_prefill_and_preemption(tiny_models):
    path = tiny_models["LlamaForCausalLM"]
    prompts = mixed_prompts(7)
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(path, device="cuda", dtype="float32", block_size=4, num_kv_blocks=16,
              max_num_batched_tokens=8)
    assert run(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0


def test_cuda_seeded_sampling_is_reproducible(tiny_models):
    llm = LLM(tiny_models["LlamaForCausalLM"], device="cuda")
    params = SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=16)
    a = llm.generate(["x", "seeded"], [greedy(), params], use_tqdm=False)[1]
    b = llm.generate(["seeded"], params, use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("backend", ["TORCH", "TRITON_ATTN"])
def test_step_never_syncs_with_the_host_before_sampling(tiny_models, backend):
    """Inputs, metadata, forward, logits and sampling run without a host-device sync; the
    step's one sync is reading the sampled tokens back."""
    llm = LLM(tiny_models["Qwen3ForCausalLM"], device="cuda", attention_backend=backend)
    engine = llm.engine
    mixed = [SamplingParams(max_tokens=4), SamplingParams(temperature=0.8, top_p=0.9, top_k=20,
                                                         repetition_penalty=1.2, max_tokens=4)]
    for i, p in enumerate(mixed_prompts(2)):
        engine.add_request({"prompt_token_ids": p}, mixed[i % 2])
    runner = engine.executor.runner
    plan = engine.scheduler.schedule()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        pending = runner.execute_async(plan)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    sampled = pending.result().sampled
    assert sorted(sampled) == sorted(plan.request_ids)
    assert all(len(tokens) == 1 for tokens in sampled.values())
