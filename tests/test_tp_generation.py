"""Tensor parallelism on the CPU (gloo, 2 worker processes) generates what one process does.

Two models: the tiny Llama (4 query heads, 2 KV heads: each rank holds 2 and 1) and a tiny
Qwen3 with one KV head (replicated on both ranks), a tied LM head and a vocabulary of 515 rows
(not divisible by 2: the last vocabulary partition is padded). Greedy tokens are also checked
against Hugging Face transformers, an independent reference."""

from __future__ import annotations

import time

import pytest
from reference import hf_greedy
from tp_support import (  # noqa: F401
    TP_TEST_TIMEOUT_S,
    only_builtin_plugins,
    qwen3_gqa_path,
    tp_llm,
)

from hitchllm import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [300, 7, 7, 7, 9, 12, 200, 5, 1], [40, 41, 42]]
MAX_TOKENS = 10
# fp32, chunked prefill (the 37-token prompt takes three steps).
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=64, max_model_len=96,
              max_num_batched_tokens=16)
# Each model runs with one way of stepping: under async scheduling the workers launch a step
# before answering the one before; without it the engine asks for every answer.
ASYNC_SCHEDULING = {"llama": False, "qwen3_gqa": True}


def params() -> list[SamplingParams]:
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [
        greedy,
        # Prompt logprobs run the LM head (and its gather) over prompt positions.
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, prompt_logprobs=2),
        # Every rank samples with the same seeded generator: they must agree (the executor
        # checks) and match one process.
        SamplingParams(temperature=1.0, top_k=50, seed=7, max_tokens=MAX_TOKENS,
                       ignore_eos=True, logprobs=2),
        # Logits processors (each worker builds its own, with its own tokenizer) and a
        # penalty (the engine then waits for each step's tokens before the next).
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True,
                       repetition_penalty=1.3, logit_bias={7: 5.0}, bad_words=["engine"]),
    ]


def generate(llm: LLM):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params(), use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
            [o.prompt_logprobs for o in outs])


def assert_logprobs_close(a, b) -> None:
    """Same tokens ranked, values equal up to the different order of the ranks' sums."""
    assert (a is None) == (b is None)
    if a is None:
        return
    assert len(a) == len(b)
    for x, y in zip(a, b):
        if x is None or y is None:
            assert x is y
            continue
        assert x.keys() == y.keys()
        for token in x:
            assert x[token].logprob == pytest.approx(y[token].logprob, abs=1e-4)
            assert x[token].rank == y[token].rank


@pytest.mark.parametrize("model", ["llama", "qwen3_gqa"])
def test_tp2_generates_what_tp1_generates(model, llama_path, qwen3_gqa_path,  # noqa: F811
                                          only_builtin_plugins):  # noqa: F811
    path = llama_path if model == "llama" else qwen3_gqa_path
    engine = dict(ENGINE, async_scheduling=ASYNC_SCHEDULING[model])
    tokens1, logprobs1, prompt_logprobs1 = generate(LLM(path, **engine))
    start = time.monotonic()
    with tp_llm(path, tensor_parallel_size=2, **engine) as llm:
        # Each rank caches its own KV heads: 2 of the Llama's 2 split, Qwen3's 1 replicated.
        assert llm.engine.executor.kv_cache_specs[0].num_kv_heads == 1
        tokens2, logprobs2, prompt_logprobs2 = generate(llm)
    assert time.monotonic() - start < TP_TEST_TIMEOUT_S
    assert tokens2 == tokens1
    assert all(len(t) == MAX_TOKENS for t in tokens2)
    assert 7 in tokens2[3]  # the logit bias bites (in the workers too, or TP=1 would differ)
    for a, b in zip(logprobs1 + prompt_logprobs1, logprobs2 + prompt_logprobs2):
        assert_logprobs_close(a, b)
    # Greedy rows against transformers.
    assert tokens2[0] == hf_greedy(path, [PROMPTS[0]], MAX_TOKENS)[0]
    assert tokens2[1] == hf_greedy(path, [PROMPTS[1]], MAX_TOKENS)[0]
