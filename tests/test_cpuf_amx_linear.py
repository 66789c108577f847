"""attention_cpu's AMX kernel for bfloat16 linears of 1-32 rows (amx_linear.c): equal to
``F.linear`` bit for bit on every row count and on odd numbers of 16-output blocks (the threaded
path too), against float64 within bfloat16 rounding, the fallbacks (more rows, a bias, float32),
dropping it after a reload, and an engine's greedy tokens with and without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hitchllm import LLM, SamplingParams
from hitchllm.layers import CPU_BF16_KERNEL, ReplicatedLinear
from hitchllm.layers.method import onednn_bf16_available
from hitchllm.models import fused
from hitchllm_attention_cpu import amx_linear

pytestmark = pytest.mark.skipif(not amx_linear.available(),
                                reason="needs a CPU with AMX-BF16 and a compiler targeting it")


def amx_layer(n, k, bias=False):
    layer = ReplicatedLinear(k, n, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k))
        layer.to(torch.bfloat16)
        if bias:
            layer.bias.normal_()
    assert amx_linear.install(layer) == 1
    assert isinstance(layer.__dict__[CPU_BF16_KERNEL], amx_linear.AmxKernel)
    return layer


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32])
@pytest.mark.parametrize("n,k", [(48, 64), (320, 192), (192, 512), (4096, 192)])
@pytest.mark.parametrize("threads", [1, 2])
def test_equals_f_linear_and_float64(rows, n, k, threads):
    torch.manual_seed(rows * n + k)
    layer = amx_layer(n, k)
    x = torch.randn(rows, 2 * k).bfloat16()[:, :k]  # strided rows, as views in a model
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            got = layer(x)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, F.linear(x, layer.weight))
    want = x.double() @ layer.weight.double().T
    torch.testing.assert_close(got.double(), want, rtol=2**-7, atol=1e-2)


def test_other_calls_keep_onednn_or_f_linear(monkeypatch):
    calls = []
    kernel_call = amx_linear.AmxKernel.__call__

    def spy(self, x):
        out = kernel_call(self, x)
        calls.append((x.shape[0], out is not None))
        return out

    monkeypatch.setattr(amx_linear.AmxKernel, "__call__", spy)
    layer = amx_layer(64, 64)
    with torch.inference_mode():
        layer(torch.randn(32, 64).bfloat16())
        x = torch.randn(33, 64).bfloat16()
        assert torch.equal(layer(x), F.linear(x, layer.weight))  # too many rows: oneDNN
    assert calls == [(32, True), (33, False)]
    if onednn_bf16_available():
        assert "_onednn_weight" in layer.__dict__
    biased = amx_layer(64, 64, bias=True)
    with torch.inference_mode():
        x = torch.randn(4, 64).bfloat16()
        assert torch.equal(biased(x), F.linear(x, biased.weight, biased.bias))
    assert len(calls) == 2  # a bias never reaches the kernel
    assert not amx_linear.takes(torch.randn(64, 64))  # float32
    assert not amx_linear.takes(torch.randn(40, 64).bfloat16())  # outputs not a multiple of 16
    assert amx_linear.install(ReplicatedLinear(48, 64).to(torch.bfloat16)) == 0  # inputs


def test_reload_drops_the_kernel():
    layer = amx_layer(32, 64)
    x = torch.randn(3, 64).bfloat16()
    with torch.inference_mode():
        first = layer(x)
    with torch.no_grad():
        layer.weight.mul_(-1)
    layer.linear_method.process_weights_after_loading(layer)
    assert CPU_BF16_KERNEL not in layer.__dict__  # no stale packed copy
    with torch.inference_mode():
        assert torch.equal(layer(x), -first)


def test_engine_tokens_identical_with_and_without(llama_path, monkeypatch):
    prompts = [[5, 9, 13, 2, 7] * k for k in (1, 3, 11)] + [[3] * 40]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = {}
    for amx in (True, False):
        if not amx:
            monkeypatch.setattr(amx_linear, "available", lambda: False)
        llm = LLM(llama_path, dtype="bfloat16", attention_backend="CPU_ATTN")
        layers = [m for m in llm.engine.executor.worker.model.modules()
                  if CPU_BF16_KERNEL in m.__dict__]
        assert bool(layers) == amx
        outs[amx] = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                 use_tqdm=False)
    fused.unregister_device_kernels("cpu")
    for a, b in zip(outs[True], outs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
