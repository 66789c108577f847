"""attention_cpu's decode layer (decode_layer.py): a decoder layer of a decode step as one C
call, in bfloat16 (AMX linears) and float32 (MKL's GEMMs). Every call an engine makes equals the
layer's modules bit for bit (Llama, Qwen3's q/k norm, the bundled model's shape; on one thread,
two (the attention shared with the helper thread) and three (OpenMP); decodes and prompts of up
to 16 tokens; in float32 both the packed GEMM of 16-32 rows and sgemm_ below), steps it does not
take (longer prompts, more than 32 rows) run the modules, and the engine's greedy tokens and
logprobs are identical with and without it, at tensor_parallel_size 1 and 2."""

from __future__ import annotations

import types

import pytest
import torch
from tp_support import tp_llm

from hitchllm import LLM, SamplingParams
from hitchllm.attention import get_forward_context
from hitchllm.bundled_model import default_model_path
from hitchllm.models import fused, llama
from hitchllm.models.llama import LAYER_KERNEL
from hitchllm.tiny_model import build_tiny_checkpoint
from hitchllm_attention_cpu import amx_linear, decode_layer, mkl_linear
from hitchllm_attention_cpu import fused as cpu_fused
from hitchllm_attention_cpu.compiler import KernelBuildError


def _float32_layer_available() -> bool:
    cpu_fused.install()
    try:
        return mkl_linear.available() and cpu_fused.float32_exact()
    finally:
        fused.unregister_device_kernels("cpu")


NEEDS_AMX = pytest.mark.skipif(not amx_linear.available(),
                               reason="needs a CPU with AMX-BF16 and a compiler targeting it")
NEEDS_F32 = pytest.mark.skipif(not _float32_layer_available(),
                               reason="needs torch with MKL and Sleef's exponential exported")
# Each dtype with the condition under which the layer takes it.
DTYPES = [pytest.param("bfloat16", marks=NEEDS_AMX), pytest.param("float32", marks=NEEDS_F32)]

# 36 requests that end at different steps: the first decode steps have more rows than the
# kernel takes (36 > 32), the later ones fewer; prompts of 5-60 tokens (over 16: SDPA).
PROMPTS = [[(7 * i + j) % 97 + 3 for j in range(5 + (i * 11) % 56)] for i in range(36)]
MAX_TOKENS = [2 + i % 9 for i in range(36)]
# Prompts of 2-11 tokens, 26 in all: a first step the kernel takes (every request through
# CPU_ATTN's kernel, at most 32 rows).
SHORT_PROMPTS = [[(5 * i + j) % 89 + 3 for j in range(2 + 3 * i)] for i in range(4)]


def generate(llm: LLM, logprobs: int | None = None) -> list:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
              for n in MAX_TOKENS]
    return llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)


def layer_kernels(llm: LLM) -> list[decode_layer.DecodeLayerKernel]:
    return [m.__dict__[LAYER_KERNEL] for m in llm.engine.executor.worker.model.modules()
            if LAYER_KERNEL in m.__dict__]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("architecture,threads", [
    ("LlamaForCausalLM", 2), ("Qwen3ForCausalLM", 2),
    ("bundled", 1), ("bundled", 2), ("bundled", 3),  # alone, with the helper, OpenMP's team
])
def test_each_call_equals_the_modules_bit_for_bit(tiny_models, architecture, threads, dtype,
                                                  monkeypatch):
    """Each call is checked against the layer's modules on the same inputs (which write the
    same keys and values to the same slots again, then attend as the kernel did). Differences
    are recorded, not raised: the engine would catch an exception in a step and run its
    requests one at a time, where the difference may not show."""
    calls: list[tuple[int, bool, int]] = []
    differ: list[int] = []
    raised: list[str] = []
    kernel_call = decode_layer.DecodeLayerKernel.__call__

    def checked(self, positions, hidden, residual):
        try:
            got = kernel_call(self, positions, hidden, residual)
        except Exception as error:
            raised.append(repr(error))
            got = None
        kernel = self.layer.__dict__.pop(LAYER_KERNEL)
        try:
            want = self.layer(positions, hidden, residual)
        finally:
            self.layer.__dict__[LAYER_KERNEL] = kernel
        if got is not None and not (torch.equal(got[0], want[0])
                                    and torch.equal(got[1], want[1])):
            differ.append(hidden.shape[0])
        requests = get_forward_context().attn_metadata.kernel
        longest = 0 if requests is None else int(requests.query_len.max())
        calls.append((hidden.shape[0], got is not None, longest))
        return want

    monkeypatch.setattr(decode_layer.DecodeLayerKernel, "__call__", checked)
    path = default_model_path() if architecture == "bundled" else tiny_models[architecture]
    llm = LLM(path, dtype=dtype, attention_backend="CPU_ATTN", cpu_threads=threads)
    try:
        assert torch.get_num_threads() == threads
        kernels = layer_kernels(llm)
        assert len(kernels) == llm.engine.model_config.num_hidden_layers
        generate(llm)
        llm.generate([{"prompt_token_ids": p} for p in SHORT_PROMPTS],
                     SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    finally:
        fused.unregister_device_kernels("cpu")
    assert not raised, raised[:3]
    assert not differ, f"outputs differ from the modules' at {sorted(set(differ))} rows"
    taken = {rows for rows, ok, _ in calls if ok}
    assert taken and max(taken) <= decode_layer.MAX_ROWS
    if dtype == "float32" and architecture == "bundled":
        # Its gate/up and down projections have packed copies: 16-32 rows take them.
        assert any(isinstance(k, mkl_linear.MklPackedLinear)
                   for kernel in kernels for _, k, _ in kernel.linears)
        assert any(rows >= mkl_linear.MIN_ROWS for rows in taken)
    assert any(ok and longest > 1 for _, ok, longest in calls)  # a prompt step
    assert any(rows > decode_layer.MAX_ROWS for rows, ok, _ in calls if not ok)  # 36 decodes
    assert any(rows > len(PROMPTS) for rows, ok, _ in calls if not ok)  # long prompt steps


@pytest.mark.parametrize("dtype", DTYPES)
def test_engine_tokens_identical_with_and_without(dtype, monkeypatch):
    outs = {}
    for enabled in (True, False):
        if not enabled:
            monkeypatch.setattr(decode_layer, "install", lambda model: 0)
        llm = LLM(default_model_path(), dtype=dtype, attention_backend="CPU_ATTN")
        assert bool(layer_kernels(llm)) == enabled
        outs[enabled] = generate(llm, logprobs=2)
    fused.unregister_device_kernels("cpu")
    for a, b in zip(outs[True], outs[False], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_it_does_not_take(tiny_models, dtype):
    """Biases (Qwen2's q/k/v) keep their modules."""
    try:
        qwen2 = LLM(tiny_models["Qwen2ForCausalLM"], dtype=dtype, attention_backend="CPU_ATTN")
        assert not layer_kernels(qwen2)
    finally:
        fused.unregister_device_kernels("cpu")


@NEEDS_F32
def test_float32_needs_the_fused_kernels_to_be_pytorchs(tiny_models, monkeypatch):
    """Where the fused kernels' float32 paths are not PyTorch's (no matching summation order
    or exponential), float32 layers keep their modules."""
    monkeypatch.setattr(cpu_fused, "silu_chunk", lambda: None)
    try:
        llm = LLM(tiny_models["LlamaForCausalLM"], dtype="float32", attention_backend="CPU_ATTN")
        assert not layer_kernels(llm)
    finally:
        fused.unregister_device_kernels("cpu")


@NEEDS_F32
def test_float32_follows_a_lower_matmul_precision(monkeypatch):
    """With ``torch.set_float32_matmul_precision("medium")`` the modules' float32 linears may
    run in bfloat16 (oneDNN): the layer, whose GEMMs are float32, steps aside."""
    taken = []
    kernel_call = decode_layer.DecodeLayerKernel.__call__
    monkeypatch.setattr(decode_layer.DecodeLayerKernel, "__call__",
                        lambda self, *args: taken.append(kernel_call(self, *args) is not None))
    try:
        llm = LLM(default_model_path(), dtype="float32", attention_backend="CPU_ATTN")
        torch.set_float32_matmul_precision("medium")
        llm.generate([{"prompt_token_ids": p} for p in SHORT_PROMPTS],
                     SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    finally:
        torch.set_float32_matmul_precision("highest")
        fused.unregister_device_kernels("cpu")
    assert taken and not any(taken)


@NEEDS_AMX
def test_without_a_build_the_modules_run(monkeypatch):
    """decode_layer.c that cannot be built leaves the layers to their modules (with a
    warning), as the other kernels do."""

    def no_build():
        raise KernelBuildError("no compiler")

    monkeypatch.setattr(decode_layer, "load_decode_layer", no_build)
    try:
        llm = LLM(default_model_path(), dtype="bfloat16", attention_backend="CPU_ATTN")
        assert not layer_kernels(llm)
        assert len(generate(llm)) == len(PROMPTS)
    finally:
        fused.unregister_device_kernels("cpu")



@pytest.fixture(scope="module")
def tp2_aligned_llama(tmp_path_factory) -> str:
    """A Llama whose every linear keeps the AMX kernel's shapes on each of two ranks (o_proj
    takes 64 inputs a rank, down_proj 128), so only the sharding can decline the layer."""
    return str(build_tiny_checkpoint(
        tmp_path_factory.mktemp("tp2-llama") / "m", "LlamaForCausalLM", hidden_size=128,
        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2))


@NEEDS_AMX
def test_tensor_parallel_tokens_identical_with_and_without(tp2_aligned_llama, monkeypatch):
    """At tensor_parallel_size=2 the layers' o/down projections sum across ranks, which one C
    call does not: the engine's tokens with fusion (where the kernel would attach) must equal
    those with it off (the modules, PyTorch's elementwise ops and linears: the AMX and fused
    kernels equal them bit for bit)."""
    monkeypatch.setenv("HITCHLLM_PLUGINS", "attention_cpu")
    tokens = {}
    for fusion in (True, False):
        with tp_llm(tp2_aligned_llama, dtype="bfloat16", attention_backend="CPU_ATTN",
                    tensor_parallel_size=2, enable_fusion=fusion) as llm:
            tokens[fusion] = [o.outputs[0].token_ids for o in generate(llm)]
    assert tokens[True] == tokens[False]


@pytest.mark.parametrize("dtype", DTYPES)
def test_sharded_layers_are_not_taken_and_the_seam_skips_kernels(tp2_aligned_llama, dtype,
                                                                   monkeypatch):
    """``takes`` declines a layer whose linears are sharded, and ``PreNormDecoderLayer``
    does not call an attached kernel in a tensor-parallel group of several ranks."""
    try:
        llm = LLM(tp2_aligned_llama, dtype=dtype, attention_backend="CPU_ATTN")
        kernels = layer_kernels(llm)
        assert kernels and all(decode_layer.takes(k.layer) for k in kernels)
        layer = kernels[0].layer
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj, layer.self_attn.qkv_proj):
            linear.tp_size = 2
            assert not decode_layer.takes(layer)
            linear.tp_size = 1
        calls = []
        kernel_call = decode_layer.DecodeLayerKernel.__call__
        monkeypatch.setattr(decode_layer.DecodeLayerKernel, "__call__",
                            lambda self, *args: calls.append(1) or kernel_call(self, *args))
        generate(llm)
        assert calls
        calls.clear()
        monkeypatch.setattr(llama, "distributed", types.SimpleNamespace(tp_world_size=lambda: 2))
        generate(llm)
        assert not calls
    finally:
        fused.unregister_device_kernels("cpu")
