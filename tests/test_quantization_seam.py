"""A quantization method plugs in per layer through ``hitchllm_quantization_methods``: an int8
weight-only method with per-output-channel scales, written here and installed as a plugin,
loads a checkpoint quantized in the test (int8 weights plus ``weight_scale`` tensors, which
reach the fused q/k/v and gate/up layers through the same weight loaders as the weights),
runs, and gives the same logits and greedy tokens as the same model with the weights
dequantized into an ordinary float checkpoint."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from fake_dists import install_fake_plugin
from quant_twin import assert_layers_match, prompt_logprobs, write_checkpoint
from safetensors.torch import load_file, save_file
from test_models_hf_parity import mixed_prompts, run

from hitchllm import LLM
from hitchllm.tiny_model import build_tiny_checkpoint

PLUGIN = """
import torch
import torch.nn.functional as F
from torch import nn

from hitchllm import hookimpl
from hitchllm.layers import LinearBase, LinearMethod, set_weight_attrs

PROCESSED = []


class Int8WeightOnly(LinearMethod):
    '''int8 weights, one float32 scale per output channel: W = weight * weight_scale[:, None].'''

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes,
                       params_dtype, weight_loader):
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=torch.int8),
                              requires_grad=False)
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, weight_loader=weight_loader, output_dim=0)
        layer.register_parameter("weight_scale", scale)

    def process_weights_after_loading(self, layer):
        PROCESSED.append(layer.prefix)

    def apply(self, layer, x, bias=None):
        out = F.linear(x, layer.weight.to(x.dtype)) * layer.weight_scale.to(x.dtype)
        return out if bias is None else out + bias


class TestInt8:
    def __init__(self, model_config):
        assert model_config.hf_config["quantization_config"]["quant_method"] == "test_int8"

    def get_linear_method(self, layer, prefix):
        # The LM head stays in float: None leaves a layer unquantized.
        return Int8WeightOnly() if isinstance(layer, LinearBase) else None


@hookimpl
def hitchllm_quantization_methods():
    return {"test_int8": TestInt8}
"""

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: ``(values, scales)``."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127
    values = (weight.float() / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
    return values, scale


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> tuple[str, str]:
    """``(int8 checkpoint, its dequantized float twin)`` of a tiny Qwen2 (q/k/v biases)."""
    root = tmp_path_factory.mktemp("int8")
    source = build_tiny_checkpoint(root / "source", "Qwen2ForCausalLM", seed=7)
    state = load_file(str(source / "model.safetensors"))
    quantized, dequantized = {}, {}
    generator = torch.Generator().manual_seed(0)
    for name, tensor in state.items():
        if name.endswith(".bias"):  # transformers initializes them to zero: make them count
            tensor = torch.randn(tensor.shape, generator=generator).to(tensor.dtype) * 0.1
        if name.endswith(".weight") and name.split(".")[-2] in PROJECTIONS:
            values, scale = quantize(tensor)
            quantized[name], quantized[f"{name[:-len('weight')]}weight_scale"] = values, scale
            dequantized[name] = (values.float() * scale[:, None]).to(tensor.dtype)
        else:
            quantized[name] = dequantized[name] = tensor
    return (write_checkpoint(source, root / "int8", quantized, {"quant_method": "test_int8"}),
            write_checkpoint(source, root / "float", dequantized))


@pytest.fixture
def plugin(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path / "site", monkeypatch, "hitchllm-test-int8", "0.1",
                        "test_int8_plugin", PLUGIN)
    import test_int8_plugin

    test_int8_plugin.PROCESSED.clear()
    return test_int8_plugin


def test_int8_checkpoint_matches_its_dequantized_float_twin(plugin, checkpoints):
    int8_path, float_path = checkpoints
    quantized = LLM(int8_path, block_size=4, dtype="float32")
    reference = LLM(float_path, block_size=4, dtype="float32")

    model = quantized.engine.executor.runner.model
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale.shape == (qkv.output_size,)
    assert type(model.lm_head.linear_method).__name__ == "UnquantizedLinearMethod"
    assert len(plugin.PROCESSED) == 4 * model.config.num_hidden_layers

    # Every projection, fed the same input, gives the float layer's output.
    assert_layers_match(quantized, reference, "weight_scale")

    # The whole model: log-softmax of the logits at every prompt position, over the full
    # vocabulary, and greedy tokens.
    prompts = mixed_prompts(5, lengths=(3, 18, 33))
    torch.testing.assert_close(prompt_logprobs(quantized, prompts),
                               prompt_logprobs(reference, prompts), rtol=1e-5, atol=1e-5)
    assert run(quantized, prompts) == run(reference, prompts)


def test_int8_checkpoints_without_scales_or_with_float_weights_are_refused(
    plugin, checkpoints, tmp_path
):
    """The method's parameters are what the checkpoint must hold: dropping the scales lists
    each missing slot; float weights are not cast into int8."""
    int8_path, float_path = map(Path, checkpoints)
    no_scales = tmp_path / "no-scales"
    shutil.copytree(int8_path, no_scales)
    state = load_file(str(no_scales / "model.safetensors"))
    save_file({n: t for n, t in state.items() if not n.endswith("weight_scale")},
              str(no_scales / "model.safetensors"))
    with pytest.raises(ValueError, match=r"is missing \d+ tensors: .*qkv_proj.weight_scale\[q\]"):
        LLM(str(no_scales), block_size=4)

    floats = tmp_path / "floats"
    shutil.copytree(float_path, floats)
    shutil.copy(int8_path / "config.json", floats / "config.json")
    with pytest.raises(ValueError, match="dtype torch.float32 does not fit torch.int8"):
        LLM(str(floats), block_size=4)
