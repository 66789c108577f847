"""bfloat16 linears on the CPU through oneDNN-prepacked weights (UnquantizedLinearMethod):
bit for bit the numbers of ``F.linear`` (torch's own bf16 GEMM, which repacks the weight
every call), any batch size,
bias or not, and a reload repacks."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hitchllm.layers.method import UnquantizedLinearMethod, onednn_bf16_available

needs_bf16 = pytest.mark.skipif(not onednn_bf16_available(),
                                reason="this CPU has no hardware bf16 (AVX-512-BF16 / AMX)")


def _layer(out_features: int, in_features: int) -> tuple[nn.Module, UnquantizedLinearMethod]:
    layer = nn.Module()
    method = UnquantizedLinearMethod()
    method.create_weights(layer, in_features, [out_features], torch.bfloat16,
                          weight_loader=lambda *a: None)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features) * 0.05)
    method.process_weights_after_loading(layer)
    return layer, method


@needs_bf16
@pytest.mark.parametrize("tokens", [1, 3, 8, 32, 257])
@pytest.mark.parametrize("with_bias", [False, True])
def test_prepacked_bf16_linear_matches_f_linear(tokens, with_bias):
    torch.manual_seed(tokens)
    layer, method = _layer(320, 192)
    bias = torch.randn(320).bfloat16() if with_bias else None
    x = torch.randn(tokens, 192).bfloat16()
    with torch.inference_mode():
        got = method.apply(layer, x, bias)
    assert "_onednn_weight" in layer.__dict__  # the prepacked path ran
    want = F.linear(x, layer.weight, bias)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert torch.equal(got, want)  # the same oneDNN kernels, bit for bit


@needs_bf16
def test_reloaded_weights_are_repacked():
    layer, method = _layer(64, 32)
    x = torch.randn(4, 32).bfloat16()
    with torch.inference_mode():
        before = method.apply(layer, x)
        with torch.no_grad():
            layer.weight.mul_(2)
        method.process_weights_after_loading(layer)  # a reload ends with this call
        after = method.apply(layer, x)
    torch.testing.assert_close(after.float(), 2 * before.float(), rtol=1e-2, atol=1e-2)


def test_float32_and_autograd_keep_f_linear():
    layer, method = _layer(16, 8)
    with torch.no_grad():
        layer.weight.data = layer.weight.data.float()
    x = torch.randn(2, 8)
    with torch.inference_mode():
        assert torch.equal(method.apply(layer, x), F.linear(x, layer.weight))
    assert "_onednn_weight" not in layer.__dict__
