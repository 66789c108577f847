"""Qwen3-MoE and Mixtral: greedy tokens equal transformers' (fp32, CPU) for tiny random
checkpoints written by ``save_pretrained``, also under chunked prefill, preemption and prefix
caching. Qwen3-MoE's checkpoint mixes sparse and dense layers (``mlp_only_layers``)."""

from __future__ import annotations

import pytest
import torch
import transformers
from reference import hf_greedy
from test_models_hf_parity import MAX_NEW, greedy, mixed_prompts, run

from hitchllm import LLM
from hitchllm.config import ModelConfig
from hitchllm.models.llama import LlamaMLP
from hitchllm.models.moe import Qwen3MoeForCausalLM, SparseMoeBlock
from hitchllm.tiny_model import MOE_ARCHITECTURES, build_tiny_checkpoint

# Small pools keep engine start-up fast; 61 tokens at most per request.
ENGINE = dict(block_size=4, num_kv_blocks=128, max_model_len=96)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> dict[str, tuple[str, list[list[int]], list[list[int]]]]:
    """Architecture -> (checkpoint, prompts, transformers' greedy tokens)."""
    root = tmp_path_factory.mktemp("moe-models")
    prompts = mixed_prompts(11)
    out = {}
    for seed, arch in enumerate(MOE_ARCHITECTURES):
        path = str(build_tiny_checkpoint(root / arch, arch, seed=seed))
        out[arch] = path, prompts, hf_greedy(path, prompts, MAX_NEW)
    return out


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_greedy_matches_transformers(moe_models, arch):
    path, prompts, expected = moe_models[arch]
    assert run(LLM(path, **ENGINE), prompts) == expected


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_chunked_prefill_matches_transformers(moe_models, arch):
    path, prompts, expected = moe_models[arch]
    llm = LLM(path, **{**ENGINE, "max_num_batched_tokens": 6})
    assert run(llm, prompts) == expected
    assert max(len(p) for p in prompts) > 6


@pytest.mark.parametrize(("arch", "caching"), [(MOE_ARCHITECTURES[0], True),
                                               (MOE_ARCHITECTURES[1], False)])
def test_preemption_keeps_tokens(moe_models, arch, caching):
    path, prompts, expected = moe_models[arch]
    llm = LLM(path, **{**ENGINE, "num_kv_blocks": 16, "enable_prefix_caching": caching})
    assert run(llm, prompts) == expected
    assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.kv_cache.num_free_blocks == 16


@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_prefix_cache_hits_keep_tokens(moe_models, arch):
    path = moe_models[arch][0]
    system = mixed_prompts(12, lengths=(20,))[0]
    prompts = [system + tail for tail in ([7, 8, 9], [10, 11, 12, 13])]
    expected = hf_greedy(path, prompts, MAX_NEW)
    llm = LLM(path, **ENGINE)
    assert run(llm, prompts[:1]) == expected[:1]
    outs = llm.generate([{"prompt_token_ids": prompts[1]}], greedy(), use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[1]
    assert outs[0].num_cached_tokens == 20


@pytest.mark.parametrize(("overrides", "sparse"), [
    (dict(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]),
     [False, True, False, False, False, True]),
    (dict(num_experts=0), [False, False, False]),
])
def test_qwen3_moe_sparse_layers_follow_transformers(tmp_path, overrides, sparse):
    """decoder_sparse_step, mlp_only_layers and an expert count of zero pick the same sparse
    layers as transformers."""
    path = build_tiny_checkpoint(tmp_path / "m", "Qwen3MoeForCausalLM", **overrides)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path)
    hf_sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    with torch.device("meta"):
        ours = Qwen3MoeForCausalLM(ModelConfig.from_pretrained(path))
    our_sparse = [isinstance(layer.mlp, SparseMoeBlock) for layer in ours.model.layers]
    assert our_sparse == hf_sparse == sparse
    assert all(isinstance(layer.mlp, LlamaMLP) for layer, s in zip(ours.model.layers, our_sparse,
                                                                  strict=True) if not s)


def test_mixtral_sliding_window_matches_transformers(tmp_path):
    path = str(build_tiny_checkpoint(tmp_path / "m", "MixtralForCausalLM", seed=5,
                                     sliding_window=8))
    prompts = mixed_prompts(13, lengths=(5, 30))
    assert run(LLM(path, **ENGINE), prompts) == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.parametrize(("overrides", "message"), [
    ({"num_experts_per_tok": 9}, r"num_experts_per_tok \(9\) must be between 1 and the number "
                                 r"of experts \(8\)"),
    ({"hidden_act": "gelu", "mlp_only_layers": []}, "activation 'gelu' is not supported"),
])
def test_bad_moe_config_is_named(tmp_path, overrides, message):
    path = build_tiny_checkpoint(tmp_path / "m", "Qwen3MoeForCausalLM")
    config = ModelConfig.from_pretrained(path)
    config.hf_config.update(overrides)
    config.hidden_act = config.hf_config["hidden_act"]
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        Qwen3MoeForCausalLM(config)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", MOE_ARCHITECTURES)
def test_cuda_graphs_match_eager_steps(moe_models, arch):
    """On CUDA decode steps replay CUDA graphs, whose capture takes the dense expert path;
    their tokens equal eager steps' (the routed path). float16: the graph backends refuse
    float32, and float16 keeps three more mantissa bits than bfloat16 against near-ties."""
    path, prompts, _ = moe_models[arch]
    common = dict(device="cuda", dtype="float16", attention_backend="TRITON_ATTN", **ENGINE)
    eager = run(LLM(path, enforce_eager=True, **common), prompts)
    llm = LLM(path, **common)
    graphs = llm.engine.executor.runner.graphs
    assert graphs.captured
    replays = []
    replay = graphs.replay
    graphs.replay = lambda size, query_len=1: replays.append(size) or replay(size, query_len)
    assert run(llm, prompts) == eager
    assert replays
