"""DeepSeek's mixture-of-experts layers against transformers' (fp32, CPU): each MoE block of a
loaded checkpoint (router choice and weights, routed plus shared experts) equals transformers'
block on the same hidden states, for V2 greedy and group-limited routing, V2-Lite and V3's
biased sigmoid routing; the V3 checkpoint's correction bias changes transformers' own tokens
(so the greedy parity tests in test_mla_deepseek_parity.py see a router that drops it); bad
routing configs are named; V3's multi-token-prediction layers are skipped. Greedy-token
parity lives in test_mla_deepseek_parity.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mla_checkpoints import MOE_CONFIGS, build_tiny_deepseek
from reference import hf_greedy, hf_model
from safetensors.torch import load_file, save_file
from test_mla_deepseek_parity import PROMPTS
from test_models_hf_parity import MAX_NEW, run

pytest.importorskip("hitchllm_attention_mla")

from hitchllm import LLM
from hitchllm.config import ModelConfig
from hitchllm_attention_mla.deepseek_moe import DeepseekMLP, DeepseekMoE


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    """The parity tests' checkpoints (same seed)."""
    root = tmp_path_factory.mktemp("deepseek-moe")
    return {name: build_tiny_deepseek(root / name, arch, seed=1, **overrides)
            for name, (arch, overrides) in MOE_CONFIGS.items()}


@pytest.mark.parametrize("name", sorted(MOE_CONFIGS))
def test_moe_blocks_match_transformers(checkpoints, name):
    path = checkpoints[name]
    ours = LLM(path, block_size=4, num_kv_blocks=16, attention_backend="TORCH_MLA"
               ).engine.executor.runner.model.model.layers
    theirs = hf_model(path, torch.float32).model.layers
    assert isinstance(ours[0].mlp, DeepseekMLP)
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in ours] == [False, True, True]
    torch.manual_seed(0)
    hidden = torch.randn(64, hf_model(path, torch.float32).config.hidden_size)
    for layer in (1, 2):
        with torch.no_grad():
            weights, ids = ours[layer].mlp.gate(hidden)
            _, hf_weights, hf_ids = theirs[layer].mlp.gate(hidden)
            out, hf_out = ours[layer].mlp(hidden), theirs[layer].mlp(hidden[None])[0]
        order, hf_order = ids.argsort(dim=1), hf_ids.argsort(dim=1)
        assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
        torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out, hf_out, rtol=1e-5, atol=1e-5)


def test_v3_correction_bias_changes_transformers_tokens(checkpoints):
    """Without its e_score_correction_bias transformers' V3 checkpoint generates other tokens,
    so the parity tests would catch a router that ignores the bias."""
    path = checkpoints["v3-moe"]
    model = hf_model(path, torch.float32)
    biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers[1:]]
    assert all(bias.abs().min() > 0 for bias in biases)
    prompts = PROMPTS[2:4]
    expected = hf_greedy(path, prompts, MAX_NEW)
    saved = [bias.clone() for bias in biases]
    try:
        for bias in biases:
            bias.zero_()
        assert hf_greedy(path, prompts, MAX_NEW) != expected
    finally:
        for bias, value in zip(biases, saved, strict=True):
            bias.copy_(value)


@pytest.mark.parametrize(("name", "overrides", "message"), [
    ("v2-moe-greedy", {"topk_method": "noaux_tc"},
     r"topk_method 'noaux_tc' is not supported; DeepSeek-V2 routes with one of"),
    ("v2-moe-grouped", {"n_group": None},
     r"'group_limited_greedy' needs n_group and topk_group"),
    ("v3-moe", {"n_group": 3}, r"n_routed_experts \(8\) does not split into n_group=3"),
    ("v3-moe", {"topk_group": 5}, r"topk_group is 5; it must be between 1 and n_group \(4\)"),
    ("v2-lite-moe", {"num_experts_per_tok": 9},
     r"num_experts_per_tok \(9\) must be between 1 and n_routed_experts \(8\)"),
])
def test_bad_routing_config_is_named(checkpoints, name, overrides, message):
    config = ModelConfig.from_pretrained(checkpoints[name])
    config.hf_config.update(overrides)
    with torch.device("meta"), pytest.raises(ValueError, match=message):
        DeepseekMoE(config, None, "model.layers.1.mlp")


def test_v3_multi_token_prediction_layers_are_skipped(checkpoints, tmp_path):
    """A V3 checkpoint stores its num_nextn_predict_layers MTP layers after the decoder's
    (``model.layers.{num_hidden_layers}``); loading skips them, as transformers does, and
    names them when the config does not declare them."""
    source = Path(checkpoints["v3-moe"])
    path = tmp_path / "v3-mtp"
    shutil.copytree(source, path)
    tensors = load_file(path / "model.safetensors")
    tensors.update({name.replace("model.layers.2.", "model.layers.3."): tensor.clone()
                    for name, tensor in tensors.items() if name.startswith("model.layers.2.")})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 3 and config["num_nextn_predict_layers"] == 1
    prompts = PROMPTS[2:4]
    engine = dict(block_size=4, num_kv_blocks=32, attention_backend="TORCH_MLA")
    assert run(LLM(str(path), **engine), prompts) == hf_greedy(str(source), prompts, MAX_NEW)
    (path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match=r"unexpected \d+ tensors: model\.layers\.3\."):
        LLM(str(path), **engine)
