"""Swap preemption with several worker processes on the CPU (gloo): under tensor parallelism
every rank swaps its own shard of each block (its KV heads) to its own host pool, under
pipeline parallelism every stage its own layers; greedy tokens under heavy preemption equal
one unpreempted process's."""

from __future__ import annotations

import time

import pytest
from tp_support import TP_TEST_TIMEOUT_S, only_builtin_plugins, tp_llm  # noqa: F401

from hitchllm import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], list(range(10, 47)), [300, 7, 7, 7, 9, 12, 200, 5, 1], [40, 41, 42]]
ENGINE = dict(dtype="float32", block_size=4, max_model_len=96, max_num_batched_tokens=16)


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("parallel", [dict(tensor_parallel_size=2),
                                      dict(pipeline_parallel_size=2)])
def test_every_worker_swaps_its_share(llama_path, only_builtin_plugins, parallel):  # noqa: F811
    expected = generate(LLM(llama_path, **ENGINE))
    start = time.monotonic()
    with tp_llm(llama_path, num_kv_blocks=20, preemption_mode="swap", swap_space=0.01,
                **parallel, **ENGINE) as llm:
        assert generate(llm) == expected
        stats = llm.engine.stats()
        assert stats.num_swap_outs > 0 and stats.num_swap_ins == stats.num_swap_outs
        assert stats.host_blocks_used == 0
    assert time.monotonic() - start < TP_TEST_TIMEOUT_S
