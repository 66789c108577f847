"""Review of the multi-LoRA plugin: the corners where adapters meet the rest of the engine
(unload and reload, abort, parallel sampling, prompt logprobs, speculative decoding), each
against PEFT, the engine's own output without the feature, or the block pool's counters."""

from __future__ import annotations

import shutil

import pytest
from lora_reference import peft_greedy, peft_model, write_adapter
from test_models_hf_parity import mixed_prompts

from hitchllm import LLM, LoRARequest, SamplingParams

MAX_NEW = 5


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory):
    base = tiny_models["LlamaForCausalLM"]
    root = tmp_path_factory.mktemp("review-adapters")
    targets = [["q_proj", "v_proj", "down_proj"], ["o_proj", "up_proj", "k_proj"]]
    paths = {f"ad{i}": write_adapter(base, root / f"ad{i}", 4, t, seed=20 + i)
             for i, t in enumerate(targets)}
    return base, paths


def greedy(n: int = MAX_NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, **kw)


def generate(llm: LLM, prompt: list[int], lora: LoRARequest | None, n: int = MAX_NEW, **kw):
    return llm.generate({"prompt_token_ids": prompt}, greedy(n, **kw), lora_request=lora,
                        use_tqdm=False)[0]


def tokens_of(llm: LLM, prompt: list[int], lora: LoRARequest | None, n: int = MAX_NEW,
              **kw) -> list[int]:
    return generate(llm, prompt, lora, n, **kw).outputs[0].token_ids


def test_reloading_a_name_from_a_rewritten_directory_serves_the_new_weights(adapters,
                                                                             tmp_path):
    """Unload an adapter, retrain it in place (same name, same directory), load it again:
    requests must run with the new weights, neither the old device slot nor KV blocks
    computed under the old weights."""
    base, paths = adapters
    path = tmp_path / "tenant"
    shutil.copytree(paths["ad0"], path)
    llm = LLM(base, enable_lora=True, max_loras=1, max_lora_rank=4, block_size=4)
    prompt = mixed_prompts(4, lengths=(13,))[0]
    lora = LoRARequest("tenant", 1, str(path))
    assert tokens_of(llm, prompt, lora) == peft_greedy(peft_model(base, paths["ad0"]), prompt,
                                                       MAX_NEW)
    llm.engine.remove_lora("tenant")
    shutil.rmtree(path)
    shutil.copytree(paths["ad1"], path)
    llm.engine.add_lora(lora)
    out = generate(llm, prompt, lora)
    assert out.outputs[0].token_ids == peft_greedy(peft_model(base, paths["ad1"]), prompt,
                                                   MAX_NEW)
    assert out.num_cached_tokens == 0  # the old load's blocks are not this load's
    assert generate(llm, prompt, lora).num_cached_tokens == 12  # its own blocks are
    assert llm.engine.kv_cache.usage == 0
