"""CPU_ATTN: the C paged-attention kernel for CPUs (plugins/attention_cpu).

The kernel against a float64 reference over paged caches with permuted blocks (decodes, short
chunks over a cached prefix, prompts routed to SDPA in the same step; GQA ratios, head sizes
with and without a specialized copy, partial blocks, sliding window, soft-cap, bfloat16
caches); the same output on one thread as on two; the kernel's build cache; what ``validate``
says; and engine tokens equal to Hugging Face's and to TORCH's.
"""

from __future__ import annotations

import pytest
import torch
from attention_reference import make_batch, reference_attention
from reference import hf_greedy
from test_models_hf_parity import MAX_NEW, mixed_prompts, run

pytest.importorskip("hitchllm_attention_cpu")

import hitchllm_attention_cpu.compiler as compiler
from hitchllm import LLM, SamplingParams
from hitchllm.attention import AttentionBackendError, AttentionSpec, select_attention_backend
from hitchllm.attention.selector import discover_backends
from hitchllm.tiny_model import ARCHITECTURES
from hitchllm_attention_cpu import CpuAttentionBackend
from hitchllm_attention_cpu.backend import KERNEL_MAX_QUERY_LEN

CASES = {
    "decode": ([1, 9, 31, 16, 100], [1, 1, 1, 1, 1]),
    "short-chunks-over-cached-prefix": ([8, 13, 0, 40], [7, 4, 16, 1]),
    "prompts-and-decodes": ([0, 12, 40, 3], [40, 1, 17, 1]),
    "prompt-only": ([0, 5], [33, 20]),
}


def spec_for(device="cpu", dtype=torch.float32, head_size=64, heads=(8, 2), block_size=16,
             **extra) -> AttentionSpec:
    return AttentionSpec(device_type=device, dtype=dtype, kv_cache_dtype=dtype,
                         head_size=head_size, num_heads=heads[0], num_kv_heads=heads[1],
                         block_size=block_size, **extra)


def run_cpu_attn(context_lens, query_lens, num_heads, num_kv_heads, head_size=32, block_size=4,
                 dtype=torch.float32, sliding_window=None, soft_cap=None, scale=None, seed=0):
    """One CPU_ATTN step over a random paged cache, and the float64 reference."""
    spec = AttentionSpec.for_device(torch.device("cpu"), dtype=dtype, kv_cache_dtype=dtype,
                                    head_size=head_size, num_heads=num_heads,
                                    num_kv_heads=num_kv_heads, block_size=block_size,
                                    sliding_window=sliding_window, logits_soft_cap=soft_cap)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 8
    backend = CpuAttentionBackend
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                   head_size), dtype=dtype)
    scale = scale or head_size**-0.5
    impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, spec)
    batch = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_size, block_size,
                       num_blocks, cache, dtype, seed=seed,
                       write_context=lambda s, k, v: impl.write_kv_cache(cache, k, v, s))
    meta = backend.get_builder_cls()(spec, torch.device("cpu")).build(batch.common)
    out = impl.forward(batch.query, batch.key, batch.value, cache, meta)
    return out, reference_attention(batch, scale, sliding_window, soft_cap, dtype), meta


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("heads", [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa4", "mqa6"])
@pytest.mark.parametrize("head_size", [32, 24])  # 32 has a specialized copy, 24 the generic
def test_kernel_matches_float64_reference(case, heads, head_size):
    out, ref, _ = run_cpu_attn(*CASES[case], *heads, head_size=head_size)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("head_size,block_size", [(64, 16), (128, 16), (256, 32), (64, 1)])
def test_kernel_head_sizes_and_block_sizes(head_size, block_size):
    out, ref, _ = run_cpu_attn([37, 0, 64, 5], [1, 9, 3, 1], 4, 2, head_size=head_size,
                               block_size=block_size, seed=1)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_kernel_sliding_window_soft_cap_and_scale():
    lens = ([30, 0, 7, 50], [1, 12, 5, 1])
    for window, cap, scale in [(8, None, None), (None, 5.0, 0.3), (5, 2.0, 1.1)]:
        out, ref, _ = run_cpu_attn(*lens, 8, 2, sliding_window=window, soft_cap=cap, scale=scale)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_kernel_reads_bfloat16_caches():
    out, ref, _ = run_cpu_attn(*CASES["prompts-and-decodes"], 8, 2, head_size=64,
                               dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16
    # The reference uses the stored (bfloat16-rounded) K/V; only the output rounding differs.
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=1e-2)


def test_requests_are_routed_by_query_length():
    lens = ([5, 0, 20, 3], [1, KERNEL_MAX_QUERY_LEN + 1, KERNEL_MAX_QUERY_LEN, 1])
    _, _, meta = run_cpu_attn(*lens, 4, 2)
    assert [p.row for p in meta.prompts] == [1]
    assert meta.kernel.query_len.tolist() == [1, KERNEL_MAX_QUERY_LEN, 1]
    assert meta.kernel.query_start.tolist() == [0, 2 + KERNEL_MAX_QUERY_LEN,
                                                2 + 2 * KERNEL_MAX_QUERY_LEN]
    # A soft-cap cannot go through SDPA: then the kernel takes every request.
    _, _, meta = run_cpu_attn(*lens, 4, 2, soft_cap=3.0)
    assert meta.prompts == [] and meta.kernel.query_len.shape[0] == 4


def test_one_thread_and_two_give_identical_outputs():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _, _ = run_cpu_attn(*CASES["short-chunks-over-cached-prefix"], 8, 2, seed=3)
        torch.set_num_threads(2)
        two, _, _ = run_cpu_attn(*CASES["short-chunks-over-cached-prefix"], 8, 2, seed=3)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


# ---- the kernel's build, and validate -------------------------------------------------------


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty kernel cache in tmp_path, and no kernel loaded yet in this process."""
    monkeypatch.setenv("HITCHLLM_CACHE_DIR", str(tmp_path))
    compiler.load_kernel.cache_clear()
    yield tmp_path / "cpu_attn"
    compiler.load_kernel.cache_clear()


def test_kernel_is_built_once_and_then_loaded_from_the_cache(fresh_build):
    kernel = compiler.load_kernel()
    assert kernel.path.parent == fresh_build and kernel.path.exists()
    built = kernel.path.stat().st_mtime_ns
    assert [p.name for p in fresh_build.iterdir()] == [kernel.path.name]  # no temp files left
    compiler.load_kernel.cache_clear()
    again = compiler.load_kernel()
    assert again.path == kernel.path and again.path.stat().st_mtime_ns == built


def test_missing_compiler_is_a_reason_that_says_what_to_set(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-hitchllm")
    [reason] = CpuAttentionBackend.validate(spec_for())
    assert "C kernel is unavailable" in reason and "CC='no-such-compiler-hitchllm'" in reason
    monkeypatch.setenv("CC", "true")  # runs, and builds nothing
    [reason] = CpuAttentionBackend.validate(spec_for())
    assert "could not build paged_attention.c" in reason


def test_validate_names_everything_it_cannot_serve():
    reasons = CpuAttentionBackend.validate(spec_for(device="cuda", dtype=torch.float16,
                                                    heads=(6, 4), use_mla=True))
    text = " | ".join(reasons)
    for expected in ("CPU only, not cuda", "MLA", "dtype torch.float16",
                     "6 query heads are not a multiple of 4"):
        assert expected in text
    mixed = AttentionSpec(device_type="cpu", dtype=torch.bfloat16, kv_cache_dtype=torch.float32,
                          head_size=64, num_heads=8, num_kv_heads=2, block_size=16)
    assert "differs from the model dtype" in CpuAttentionBackend.validate(mixed)[0]
    assert CpuAttentionBackend.validate(spec_for(dtype=torch.bfloat16)) == []


def test_plugin_registers_and_wins_auto_mode_on_cpu(monkeypatch):
    # Only this plugin and the core: with TRITON_INTERPRET=1 set for the tests, TRITON_ATTN
    # (priority 100) would otherwise be valid on the CPU too.
    monkeypatch.setenv("HITCHLLM_PLUGINS", "hitchllm-attention-cpu")
    monkeypatch.delenv("HITCHLLM_ATTENTION_BACKEND")
    found = {backend.name: info for backend, info in discover_backends()}
    assert set(found) == {"CPU_ATTN", "TORCH"}
    assert found["CPU_ATTN"].distribution == "hitchllm-attention-cpu"
    assert select_attention_backend(spec_for()).name == "CPU_ATTN"
    with pytest.raises(AttentionBackendError, match="CPU only"):
        select_attention_backend(spec_for(device="cuda", dtype=torch.bfloat16),
                                 forced="CPU_ATTN")


# ---- the engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_engine_greedy_matches_transformers(tiny_models, arch):
    path = tiny_models[arch]
    prompts = mixed_prompts()
    llm = LLM(path, block_size=8, attention_backend="CPU_ATTN")
    assert llm.engine.attention_backend.name == "CPU_ATTN"
    assert run(llm, prompts) == hf_greedy(path, prompts, MAX_NEW)


def test_engine_chunked_prefill_prefix_cache_and_bfloat16_track_torch(llama_path):
    prompts = mixed_prompts(seed=4, lengths=(40, 3, 90, 17, 61))
    prompts.append([*prompts[2][:70], 5, 6, 7])  # shares cached blocks with the third prompt
    for dtype in ("float32", "bfloat16"):
        tokens = {}
        for name in ("CPU_ATTN", "TORCH"):
            llm = LLM(llama_path, block_size=8, max_num_batched_tokens=48, dtype=dtype,
                      attention_backend=name)
            tokens[name] = run(llm, prompts, 12)
        if dtype == "float32":
            assert tokens["CPU_ATTN"] == tokens["TORCH"]
        else:  # different float32 summation orders may flip a near tie in bfloat16
            same = sum(a == b for x, y in zip(*tokens.values()) for a, b in zip(x, y))
            assert same >= 0.9 * sum(len(x) for x in tokens["TORCH"])


def test_engine_sampling_and_logprobs_agree_with_torch(llama_path):
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=10, logprobs=3)
    outs = {}
    for name in ("CPU_ATTN", "TORCH"):
        llm = LLM(llama_path, attention_backend=name)
        outs[name] = llm.generate(["hello world", "a b c d e f"], params, use_tqdm=False)
    for ours, ref in zip(outs["CPU_ATTN"], outs["TORCH"]):
        assert ours.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ours.outputs[0].logprobs, ref.outputs[0].logprobs):
            for tok in b:
                assert abs(a[tok].logprob - b[tok].logprob) < 1e-4
