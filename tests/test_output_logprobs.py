"""vLLM's output fields offline: ``cumulative_logprob``, ``Logprob.decoded_token`` and
``SamplingParams.truncate_prompt_tokens``, checked against transformers in float64."""

from __future__ import annotations

import pytest
import torch
from reference import hf_model
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(llama_path):
    # Module-scoped, so it starts before conftest's per-test forcing of the reference backend.
    return LLM(llama_path, block_size=4, max_model_len=64, attention_backend="TORCH")


def test_cumulative_logprob_is_the_sum_of_sampled_logprobs(llm, llama_path):
    prompts = mixed_prompts(31, lengths=(11, 6))
    params = SamplingParams(max_tokens=7, temperature=1.0, seed=5, n=2, logprobs=1,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = hf_model(llama_path, torch.float64)
    for prompt, out in zip(prompts, outs):
        for seq in out.outputs:
            full = prompt + seq.token_ids
            with torch.no_grad():
                ref = model(torch.tensor([full])).logits[0].log_softmax(-1)
            expected = [ref[len(prompt) + j - 1, t].item() for j, t in enumerate(seq.token_ids)]
            got = [entry[t].logprob for t, entry in zip(seq.token_ids, seq.logprobs)]
            assert got == pytest.approx(expected, abs=1e-4)
            assert seq.cumulative_logprob == pytest.approx(sum(got), abs=1e-9)
            assert seq.cumulative_logprob == pytest.approx(sum(expected), abs=1e-3)


def test_cumulative_logprob_is_none_without_logprobs(llm):
    out = llm.generate("def f(x):", SamplingParams(max_tokens=3), use_tqdm=False)[0]
    assert out.outputs[0].cumulative_logprob is None and out.outputs[0].logprobs is None


def test_decoded_token_is_the_token_text(llm):
    tokenizer = llm.get_tokenizer()
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=3, prompt_logprobs=2)
    out = llm.generate("def add(a, b):\n    return", params, use_tqdm=False)[0]
    entries = [e for e in out.prompt_logprobs if e is not None] + out.outputs[0].logprobs
    assert len(entries) == len(out.prompt_token_ids) - 1 + 5
    for entry in entries:
        assert len(entry) >= 2
        for token, lp in entry.items():
            assert lp.decoded_token == tokenizer.decode([token])

    raw = llm.generate("def add(a, b):", SamplingParams(
        max_tokens=2, logprobs=1, prompt_logprobs=1, detokenize=False), use_tqdm=False)[0]
    assert all(lp.decoded_token is None for e in raw.outputs[0].logprobs for lp in e.values())
    assert all(lp.decoded_token is None for e in raw.prompt_logprobs[1:] for lp in e.values())


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    prompt = mixed_prompts(32, lengths=(40,))[0]
    greedy = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    cut = llm.generate({"prompt_token_ids": prompt},
                       SamplingParams(truncate_prompt_tokens=9, **greedy), use_tqdm=False)[0]
    tail = llm.generate({"prompt_token_ids": prompt[-9:]}, SamplingParams(**greedy),
                        use_tqdm=False)[0]
    assert cut.prompt_token_ids == prompt[-9:]
    assert cut.outputs[0].token_ids == tail.outputs[0].token_ids
    # -1 keeps the last max_model_len tokens: 80 tokens would not fit the 64-token context.
    long = prompt * 2
    out = llm.generate({"prompt_token_ids": long},
                       SamplingParams(truncate_prompt_tokens=-1, max_tokens=1), use_tqdm=False)[0]
    assert out.prompt_token_ids == long[-64:]
    short = llm.generate({"prompt_token_ids": prompt[:5]},
                         SamplingParams(truncate_prompt_tokens=9, max_tokens=1), use_tqdm=False)[0]
    assert short.prompt_token_ids == prompt[:5]


@pytest.mark.parametrize("k", [0, -2, 1.5])
def test_truncate_prompt_tokens_is_validated(k):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        SamplingParams(truncate_prompt_tokens=k)


def test_truncate_beyond_max_model_len_is_rejected(llm):
    with pytest.raises(ValueError, match="truncate_prompt_tokens=65 exceeds max_model_len=64"):
        llm.generate("x", SamplingParams(truncate_prompt_tokens=65), use_tqdm=False)
