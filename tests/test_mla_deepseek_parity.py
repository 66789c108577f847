"""Greedy tokens of the DeepSeek models on TORCH_MLA equal transformers' (fp32, CPU), for
V2-Lite (no q_lora_rank), V2 with q_lora_rank and YaRN, V3 with YaRN, and mixture-of-experts
checkpoints (V2 greedy and group-limited routing, V2-Lite, V3 with a correction bias): in mixed
prefill/decode batches, under chunked prefill over a cached prefix, and under preemption."""

from __future__ import annotations

import pytest
import torch
from mla_checkpoints import CONFIGS, MOE_CONFIGS, build_tiny_deepseek
from reference import hf_greedy
from test_models_hf_parity import MAX_NEW, greedy, mixed_prompts, run

pytest.importorskip("hitchllm_attention_mla")

from hitchllm import LLM

SYSTEM = mixed_prompts(11, lengths=(22,))[0]
PROMPTS = [[*SYSTEM, 7, 8, 9], [*SYSTEM, 10, 11], *mixed_prompts(5, lengths=(1, 6, 13, 40))]
ALL_CONFIGS = {**CONFIGS, **MOE_CONFIGS}


@pytest.fixture(scope="module", params=sorted(ALL_CONFIGS))
def reference(request, tmp_path_factory):
    arch, overrides = ALL_CONFIGS[request.param]
    path = build_tiny_deepseek(tmp_path_factory.mktemp(request.param), arch, seed=1,
                               **overrides)
    return path, hf_greedy(path, PROMPTS, MAX_NEW)


def test_mixed_batch_matches_transformers(reference):
    path, expected = reference
    llm = LLM(path, block_size=4, attention_backend="TORCH_MLA")
    assert run(llm, PROMPTS) == expected


def test_chunked_prefill_over_cached_prefix_matches_transformers(reference):
    """The first prompt warms the prefix cache; the second reuses its 5 shared blocks and
    prefills the rest in chunks of 4 tokens over them, as do the others."""
    path, expected = reference
    llm = LLM(path, block_size=4, max_num_batched_tokens=4, attention_backend="TORCH_MLA")
    assert run(llm, PROMPTS[:1]) == expected[:1]
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[1:]], greedy(),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[1:]
    assert outs[0].num_cached_tokens == 20


def test_preemption_keeps_tokens(reference):
    path, expected = reference
    # 16 blocks of 4 tokens: the longest request alone needs 14 of them, so steps preempt.
    llm = LLM(path, block_size=4, num_kv_blocks=16, attention_backend="TORCH_MLA")
    assert run(llm, PROMPTS) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv_cache.num_free_blocks == 16


def test_bfloat16_on_cpu_tracks_transformers(tmp_path):
    """In bf16 rounding may flip a near-tie late in a sequence; the first tokens must agree."""
    arch, overrides = CONFIGS["v3-yarn"]
    path = build_tiny_deepseek(tmp_path / "v3", arch, seed=3, **overrides)
    prompts = PROMPTS[1:3]
    ours = run(LLM(path, dtype="bfloat16", attention_backend="TORCH_MLA"), prompts, max_tokens=4)
    ref = hf_greedy(path, prompts, 4, dtype=torch.bfloat16)
    assert [o[:2] for o in ours] == [r[:2] for r in ref]
