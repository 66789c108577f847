"""Greedy tokens equal Hugging Face transformers' generate for the Llama family."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from reference import hf_greedy

from hitchllm import LLM, SamplingParams
from hitchllm.tiny_model import ARCHITECTURES, build_tiny_checkpoint

MAX_NEW = 16


def mixed_prompts(seed: int = 0, lengths=(1, 3, 7, 16, 29, 45)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]


def greedy(max_tokens: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def run(llm: LLM, prompts: list[list[int]], max_tokens: int = MAX_NEW) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def run_staggered(llm: LLM) -> list[list[int]]:
    """Greedy tokens of nine mixed-length prompts that stop after 1 to 40 tokens (EOS
    ignored), so the decode batch shrinks step by step: CUDA graphs replay at many sizes."""
    prompts = mixed_prompts(3, lengths=(1, 3, 7, 16, 29, 45, 5, 12, 33))
    lens = (40, 3, 17, 25, 9, 33, 1, 12, 28)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in lens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_matches_transformers_mixed_batch(tiny_models, arch):
    path = tiny_models[arch]
    prompts = mixed_prompts()
    llm = LLM(path, block_size=8)
    assert run(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)


@pytest.mark.parametrize(
    "overrides",
    [
        {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
        {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}},
        {"tie_word_embeddings": True, "attention_bias": True, "num_key_value_heads": 1},
    ],
    ids=["linear-rope", "llama3-rope", "tied-bias-mqa"],
)
def test_llama_variants_match_transformers(tmp_path, overrides):
    path = str(build_tiny_checkpoint(tmp_path / "m", "LlamaForCausalLM", seed=3, **overrides))
    prompts = mixed_prompts(1, lengths=(5, 40))
    assert run(LLM(path, block_size=4), prompts) == hf_greedy(path, prompts, MAX_NEW)


def test_tied_qwen2_matches_transformers(tmp_path):
    path = str(build_tiny_checkpoint(tmp_path / "m", "Qwen2ForCausalLM", seed=4,
                                     tie_word_embeddings=True))
    prompts = mixed_prompts(2, lengths=(9, 30))
    assert run(LLM(path), prompts) == hf_greedy(path, prompts, MAX_NEW)


def test_sharded_checkpoint_and_old_style_config(tmp_path):
    """Weights split over several files with an index, and a config.json written the
    pre-transformers-5 way (rope_theta / rope_scaling / torch_dtype)."""
    from transformers import AutoModelForCausalLM

    src = build_tiny_checkpoint(tmp_path / "src", "LlamaForCausalLM", seed=5,
                                rope_scaling={"rope_type": "linear", "factor": 2.0},
                                rope_theta=5000.0)
    model = AutoModelForCausalLM.from_pretrained(src)
    dst = tmp_path / "sharded"
    model.save_pretrained(dst, max_shard_size="100KB")
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (Path(src) / f).exists():
            (dst / f).write_bytes((Path(src) / f).read_bytes())
    assert (dst / "model.safetensors.index.json").exists()
    cfg = json.loads((dst / "config.json").read_text())
    rope = cfg.pop("rope_parameters")
    assert rope["rope_theta"] == 5000.0
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    cfg["torch_dtype"] = cfg.pop("dtype")
    (dst / "config.json").write_text(json.dumps(cfg))

    prompts = mixed_prompts(3, lengths=(6, 33))
    ours = run(LLM(str(dst)), prompts)
    assert ours == hf_greedy(str(src), prompts, MAX_NEW)


def test_bfloat16_on_cpu_tracks_transformers(tiny_models):
    """In bf16 rounding may flip a near-tie late in a sequence; the first tokens must agree."""
    path = tiny_models["Qwen3ForCausalLM"]
    prompts = mixed_prompts(4, lengths=(4, 21))
    ours = run(LLM(path, dtype="bfloat16"), prompts, max_tokens=4)
    ref = hf_greedy(path, prompts, 4, dtype=torch.bfloat16)
    assert [o[:2] for o in ours] == [r[:2] for r in ref]


def test_unsupported_architecture_is_named(tmp_path, llama_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    cfg = json.loads((Path(llama_path) / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (bad / "config.json").write_text(json.dumps(cfg))
    for f in Path(llama_path).iterdir():
        if f.name != "config.json":
            (bad / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        LLM(str(bad))
