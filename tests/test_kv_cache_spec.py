"""Per-layer KV-cache specs and the fp8 KV cache: sizing from the specs, TORCH's fp8 path
against a float64 reference on the fp8-rounded K/V, and backends refusing fp8 with a reason."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil

import pytest
import torch
from attention_reference import make_batch, reference_attention
from test_torch_attention import CASES

from hitchllm import LLM, SamplingParams, default_model_path, hookimpl
from hitchllm.attention import (
    Attention,
    AttentionSpec,
    KVCacheKind,
    KVCacheSpec,
    TorchAttentionBackend,
    bytes_per_shared_block,
    kernel_reasons,
    nhd_cache_shape,
    quantize_kv,
)
from hitchllm.attention.selector import (
    AttentionBackendError,
    select_attention_backend,
)
from hitchllm.config import EngineConfig
from hitchllm.plugins import get_plugin_registry

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


# ---- the spec: bytes per block -----------------------------------------------------------------

def test_mla_latent_spec_stores_one_latent_vector_per_token():
    # DeepSeek V3: kv_lora_rank 512 plus a 64-wide rotary key part, cached in bfloat16.
    spec = KVCacheSpec.for_mla(kv_lora_rank=512, rope_head_dim=64, dtype=torch.bfloat16,
                               block_size=16)
    assert spec.kind is KVCacheKind.MLA_LATENT and spec.head_size == 576
    one_block = torch.empty(16, 576, dtype=torch.bfloat16)  # no separate K and V
    assert spec.bytes_per_block == one_block.nbytes == 18432
    fp8 = dataclasses.replace(spec, dtype=torch.float8_e4m3fn)
    assert fp8.bytes_per_block == 9216


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_attention_spec_bytes_per_block_match_the_backends_cache_tensors(dtype):
    spec = KVCacheSpec.for_attention(num_kv_heads=8, head_size=128, dtype=dtype, block_size=16)
    assert spec.bytes_per_block == 2 * 8 * 128 * 16 * dtype.itemsize
    # A block more in the pool is that many more bytes in each layout the backends use.
    for shape_of in (lambda n: TorchAttentionBackend.get_kv_cache_shape_for_spec(n, spec),
                     lambda n: nhd_cache_shape(n, 16, 8, 128)):
        grown = math.prod(shape_of(11)) - math.prod(shape_of(10))
        assert grown * dtype.itemsize == spec.bytes_per_block


def test_a_shared_block_costs_every_layers_page_and_needs_one_block_size():
    full = KVCacheSpec.for_attention(2, 64, torch.bfloat16, 16)
    window = KVCacheSpec.for_attention(2, 64, torch.bfloat16, 16, sliding_window=128)
    mla = KVCacheSpec.for_mla(256, 32, torch.bfloat16, 16)
    assert window.kind is KVCacheKind.SLIDING_WINDOW
    assert bytes_per_shared_block([full, window, mla]) == 2 * 8192 + 288 * 2 * 16
    with pytest.raises(ValueError, match="different block sizes"):
        bytes_per_shared_block([full, dataclasses.replace(full, block_size=32)])


def test_inconsistent_specs_are_refused():
    with pytest.raises(ValueError, match="num_kv_heads=1"):
        KVCacheSpec(KVCacheKind.MLA_LATENT, 4, 576, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="sliding_window"):
        KVCacheSpec(KVCacheKind.SLIDING_WINDOW, 2, 64, torch.bfloat16, 16)
    mla = KVCacheSpec.for_mla(512, 64, torch.bfloat16, 16)
    with pytest.raises(ValueError, match="MLA latent cache"):
        TorchAttentionBackend.get_kv_cache_shape_for_spec(10, mla)


# ---- sizing from the specs ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype, kv_cache_dtype, ratio", [
    ("float32", "auto", 1), ("bfloat16", "auto", 2), ("float32", "fp8", 4),
    ("bfloat16", "fp8_e5m2", 4),
])
def test_same_kv_cache_memory_holds_more_blocks_in_smaller_dtypes(llama_path, dtype,
                                                                  kv_cache_dtype, ratio):
    def engine(**kw):
        return LLM(llama_path, kv_cache_memory="256KiB", max_model_len=64, **kw).engine

    base = engine(dtype="float32").num_kv_blocks
    e = engine(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert e.num_kv_blocks == ratio * base
    # What was allocated is what was sized: TORCH's tensors hold one spare block each.
    runner = e.executor.runner
    per_block = bytes_per_shared_block(runner.kv_cache_specs)
    assert sum(c.nbytes for c in runner.kv_caches) == (e.num_kv_blocks + 1) * per_block
    assert {c.dtype for c in runner.kv_caches} == {runner.kv_cache_specs[0].dtype}


# ---- TORCH with an fp8 cache -------------------------------------------------------------------

def fp8_rounded(x: torch.Tensor, scale: float, model_dtype: torch.dtype,
                fp8: torch.dtype) -> torch.Tensor:
    """What an fp8 cache holds for ``x``, read back exactly (float64)."""
    limit = torch.finfo(fp8).max
    stored = (x.to(model_dtype).float() / scale).clamp(-limit, limit).to(fp8)
    return stored.double() * scale


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("kv_name", sorted(FP8))
def test_torch_fp8_attention_equals_float64_attention_over_fp8_rounded_kv(case, kv_name, device):
    fp8, model_dtype = FP8[kv_name], torch.float32
    heads, kv_heads, head_size, block_size, num_blocks = 8, 2, 16, 4, 40
    context_lens, query_lens = CASES[case]
    spec = AttentionSpec(device_type=device, dtype=model_dtype, kv_cache_dtype=fp8,
                         head_size=head_size, num_heads=heads, num_kv_heads=kv_heads,
                         block_size=block_size)
    assert TorchAttentionBackend.validate(spec) == []
    kv_spec = KVCacheSpec.for_attention(kv_heads, head_size, fp8, block_size)
    cache = torch.zeros(TorchAttentionBackend.get_kv_cache_shape_for_spec(num_blocks, kv_spec),
                        dtype=fp8, device=device)
    scale = head_size**-0.5
    impl = TorchAttentionBackend.get_impl_cls()(heads, head_size, scale, kv_heads, spec)
    # Scales other than 1.0, as a quantization method would set them.
    k_scale, v_scale = 0.05, 0.5
    impl.k_scale = torch.tensor(k_scale, device=device)
    impl.v_scale = torch.tensor(v_scale, device=device)

    def write(slots, k, v):
        impl.write_kv_cache(cache, k, v, slots)

    batch = make_batch(context_lens, query_lens, heads, kv_heads, head_size, block_size,
                       num_blocks, cache, model_dtype, write_context=write)
    meta = TorchAttentionBackend.get_builder_cls()(spec, torch.device(device)).build(batch.common)
    out = impl.forward(batch.query, batch.key, batch.value, cache, meta).cpu()

    rounded = dataclasses.replace(
        batch,
        full_keys=[fp8_rounded(k, k_scale, model_dtype, fp8) for k in batch.full_keys],
        full_values=[fp8_rounded(v, v_scale, model_dtype, fp8) for v in batch.full_values])
    ref = reference_attention(rounded, scale, dtype=torch.float64)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    # The rounding is real: full-precision K/V give a visibly different result.
    exact = reference_attention(batch, scale, dtype=torch.float64)
    assert (out.double() - exact).abs().max() > 1e-3


@pytest.mark.parametrize("fp8", sorted(FP8.values(), key=str))
def test_values_beyond_the_fp8_range_saturate_instead_of_becoming_nan(fp8):
    x = torch.tensor([1e6, -1e6, 3.0])
    stored = quantize_kv(x, torch.tensor(1.0), fp8)
    limit = torch.finfo(fp8).max
    assert stored.float().tolist() == [limit, -limit, 3.0]


CODE_PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\ndef main(",
                "class Stack:\n    def __init__(self):\n", "for i in range(10):\n",
                "def read_file(path):\n    with open(path) as f:\n",
                "# Sort a list of numbers\ndef sort(", "if __name__ == '__main__':\n",
                "def add(a, b):\n    return"]


def greedy_agreement(full: LLM, fp8: LLM) -> float:
    """Share of greedy tokens equal in the two engines, counting each sequence up to its first
    divergence (after it the contexts differ)."""
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    a, b = ([o.outputs[0].token_ids for o in llm.generate(CODE_PROMPTS, params)]
            for llm in (full, fp8))
    agreeing = sum(next((i for i, (x, y) in enumerate(zip(f, q)) if x != y), len(f))
                   for f, q in zip(a, b))
    return agreeing / sum(len(f) for f in a)


def test_fp8_engine_greedy_tokens_mostly_follow_the_full_precision_engine():
    """fp8 K/V only round the cache, so greedy tokens mostly agree with the float32 cache's.
    Measured with the bundled (trained) code model, 8 prompts x 16 tokens: 89.8% of tokens
    agree up to each sequence's first divergence, 6 of 8 sequences identical (fp8_e5m2, with
    one mantissa bit less: 78.1%, 4 of 8). A broken fp8 path (wrong scale or slots) agrees on
    almost nothing; a random tiny model, whose logits nearly tie, would say little."""
    rate = greedy_agreement(LLM(default_model_path()),
                            LLM(default_model_path(), kv_cache_dtype="fp8"))
    print(f"fp8: {rate:.1%} of greedy tokens equal to the float32 cache's")
    assert rate >= 0.75


@pytest.mark.gpu
def test_fp8_on_cuda_auto_mode_picks_triton_and_follows_bf16(auto_backend):
    model = default_model_path()
    fp8 = LLM(model, device="cuda", kv_cache_dtype="fp8", kv_cache_memory="256MiB")
    assert fp8.engine.attention_backend.name == "TRITON_ATTN"  # reads fp8 (priority 100)
    assert fp8.engine.executor.runner.kv_caches[0].dtype == torch.float8_e4m3fn
    full = LLM(model, device="cuda", kv_cache_memory="256MiB", attention_backend="TORCH")
    rate = greedy_agreement(full, fp8)
    print(f"CUDA fp8: {rate:.1%} of greedy tokens equal to the bfloat16 cache's")
    assert rate >= 0.5


def test_layers_bind_their_scales_to_the_impl(llama_path):
    runner = LLM(llama_path, kv_cache_dtype="fp8").engine.executor.runner
    for layer in runner.layers:
        assert layer.impl.k_scale is layer.k_scale and layer.impl.v_scale is layer.v_scale
        assert layer.k_scale.dtype == torch.float32 and float(layer.k_scale) == 1.0


# ---- backends accept or refuse fp8 -------------------------------------------------------------

def fp8_spec(device="cpu", dtype=torch.float32, capability=None) -> AttentionSpec:
    return AttentionSpec(device_type=device, dtype=dtype, kv_cache_dtype=torch.float8_e4m3fn,
                         head_size=128, num_heads=32, num_kv_heads=8, block_size=16,
                         device_capability=capability)


def test_kernel_backends_refuse_fp8_with_a_reason(monkeypatch):
    reason = "an fp8 KV cache (torch.float8_e4m3fn) is not supported"
    gpu = fp8_spec("cuda", torch.bfloat16, (9, 0))
    assert any(r.startswith(reason) and "kv_cache_dtype=auto" in r
               for r in kernel_reasons(gpu))
    flash = pytest.importorskip("hitchllm_attention_flash.backend")
    # As if its library were installed: fp8 is then the reason left. (TRITON_ATTN, FLASHINFER
    # and CPU_ATTN read fp8: tests/test_quant_fp8_kv_kernels.py, tests/test_quant_fp8_kv.py.)
    monkeypatch.setattr(flash, "fa4_installed", lambda: True)
    reasons = flash.FlashAttentionBackend.validate(gpu)
    assert len(reasons) == 1 and reasons[0].startswith(reason), reasons


def test_torch_accepts_fp8_and_refuses_other_mixed_dtypes():
    assert TorchAttentionBackend.validate(fp8_spec()) == []
    e5m2 = dataclasses.replace(fp8_spec(), kv_cache_dtype=torch.float8_e5m2)
    assert TorchAttentionBackend.validate(e5m2) == []
    mixed = dataclasses.replace(fp8_spec(), kv_cache_dtype=torch.float16)
    assert TorchAttentionBackend.validate(mixed) == [
        "KV-cache dtype torch.float16 is not supported (use the model dtype, or fp8_e4m3 / "
        "fp8_e5m2)"]


def test_auto_mode_with_fp8_picks_a_backend_that_reads_fp8(auto_backend):
    backend = select_attention_backend(fp8_spec(), None, get_plugin_registry())
    assert backend.validate(fp8_spec()) == []


class HalfOnlyBackend(TorchAttentionBackend):
    """A kernel backend that reads K/V in the model dtype only (refuses fp8)."""

    name = "HALF_ONLY"

    @classmethod
    def validate(cls, spec):
        return kernel_reasons(spec, dtypes=(torch.float32,))


class HalfOnlyPlugin:
    @hookimpl
    def hitchllm_attention_backends(self):
        return [HalfOnlyBackend]


def test_forcing_a_backend_that_cannot_read_fp8_quotes_its_reason():
    registry = get_plugin_registry()
    registry.pm.register(HalfOnlyPlugin(), name="half-only")
    with pytest.raises(AttentionBackendError, match=r"HALF_ONLY .* was forced but cannot serve"
                       r".*an fp8 KV cache \(torch.float8_e4m3fn\) is not supported"):
        select_attention_backend(fp8_spec(), "HALF_ONLY", registry)


# ---- the engine argument -----------------------------------------------------------------------

def test_kv_cache_dtype_names(llama_path):
    config = EngineConfig(model=llama_path, kv_cache_dtype="fp8")
    assert config.resolve_kv_cache_dtype(torch.bfloat16) is torch.float8_e4m3fn
    assert EngineConfig(model=llama_path, kv_cache_dtype="fp8_e5m2").resolve_kv_cache_dtype(
        torch.bfloat16) is torch.float8_e5m2
    assert EngineConfig(model=llama_path).resolve_kv_cache_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="^kv_cache_dtype: Input should be 'auto', 'fp8'"):
        EngineConfig(model=llama_path, kv_cache_dtype="int8")


# ---- MLA through the selector ------------------------------------------------------------------

def test_an_mla_config_reaches_validate_as_use_mla_with_the_latent_width(llama_path, tmp_path,
                                                                        monkeypatch):
    model = tmp_path / "mla"
    shutil.copytree(llama_path, model)
    config = json.loads((model / "config.json").read_text())
    config.update(kv_lora_rank=32, qk_rope_head_dim=8)
    (model / "config.json").write_text(json.dumps(config))
    seen = []
    validate = TorchAttentionBackend.validate.__func__
    monkeypatch.setattr(TorchAttentionBackend, "validate",
                        classmethod(lambda cls, spec: seen.append(spec) or validate(cls, spec)))
    with pytest.raises(AttentionBackendError, match="MLA models need an MLA attention backend"):
        LLM(str(model))
    assert seen[0].use_mla and seen[0].head_size == 40 and seen[0].num_kv_heads == 1


def test_layers_whose_kv_cache_kind_contradicts_the_spec_are_refused(llama_path, monkeypatch):
    monkeypatch.setattr(Attention, "get_kv_cache_spec",
                        lambda self, block_size, dtype: KVCacheSpec.for_mla(32, 8, dtype,
                                                                            block_size))
    with pytest.raises(ValueError, match="with use_mla=False every attention layer must "
                                         "declare no MLA latent KV cache"):
        LLM(llama_path)
