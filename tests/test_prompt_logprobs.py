"""Prompt logprobs equal transformers' log-softmax of the prompt's logits, however the prompt
is scheduled (chunked, preempted, after an identical cached prompt, n > 1)."""

from __future__ import annotations

import pytest
import torch
from reference import hf_model
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams


@pytest.mark.parametrize("engine_args", [
    {},
    {"max_num_batched_tokens": 8},
    {"num_kv_blocks": 12, "max_num_batched_tokens": 16},
], ids=["one-shot", "chunked", "tiny-cache"])
def test_prompt_logprobs_match_transformers(tiny_models, engine_args):
    path = tiny_models["Qwen2ForCausalLM"]
    prompts = mixed_prompts(21, lengths=(30, 17, 9))
    llm = LLM(path, block_size=4, **engine_args)
    params = SamplingParams(max_tokens=3, prompt_logprobs=2, n=2, temperature=1.0, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = hf_model(path)
    for prompt, out in zip(prompts, outs):
        with torch.no_grad():
            ref = model(torch.tensor([prompt])).logits[0].double().log_softmax(-1)
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for i in range(1, len(prompt)):
            entry = lps[i]
            row = ref[i - 1]
            assert entry[prompt[i]].logprob == pytest.approx(row[prompt[i]].item(), abs=1e-4)
            assert entry[prompt[i]].rank == int((row > row[prompt[i]]).sum()) + 1
            assert set(row.topk(2).indices.tolist()) <= set(entry)


def test_prompt_logprobs_bypass_the_prefix_cache(tiny_models):
    path = tiny_models["LlamaForCausalLM"]
    prompt = {"prompt_token_ids": mixed_prompts(22, lengths=(20,))[0]}
    llm = LLM(path, block_size=4)
    first = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=0),
                         use_tqdm=False)[0]
    again = llm.generate(prompt, SamplingParams(max_tokens=2, prompt_logprobs=0),
                         use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert all(e is not None for e in again.prompt_logprobs[1:])
    assert [next(iter(e.values())).logprob for e in again.prompt_logprobs[1:]] == pytest.approx(
        [next(iter(e.values())).logprob for e in first.prompt_logprobs[1:]], abs=1e-6)
