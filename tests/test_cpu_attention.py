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
from hitchllm.attention import AttentionSpec, CommonAttentionMetadata
from hitchllm.attention.selector import (
    AttentionBackendError,
    discover_backends,
    select_attention_backend,
)
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
                 dtype=torch.float32, sliding_window=None, soft_cap=None, scale=None, seed=0,
                 query_scale=1.0):
    """One CPU_ATTN step over a random paged cache, and the float64 reference.

    As in the engine, the block table is a view of a wider buffer whose unused columns hold
    other (valid) block ids, so a kernel reading past a request's blocks, or stepping rows by
    the wrong stride, reads the wrong keys. ``query_scale`` widens the score range."""
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
    table = batch.common.block_table
    wide = torch.randint(0, num_blocks, (table.shape[0], table.shape[1] + 7), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(seed + 1))
    wide[:, : table.shape[1]] = table
    for i, (c, q) in enumerate(zip(context_lens, query_lens)):  # beyond a request's own blocks
        wide[i, -(-(c + q) // block_size):] = wide[i, -1]
    batch.common.block_table = wide
    batch.query.mul_(query_scale)
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


def test_kernel_keeps_float32_accuracy_over_a_wide_score_range():
    # Scores of several hundred: most weights underflow the exponential's range, the running
    # maximum jumps between blocks; the result must still match to float32 rounding.
    out, ref, _ = run_cpu_attn(*CASES["short-chunks-over-cached-prefix"], 8, 2, head_size=64,
                               query_scale=60.0, seed=5)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("head_size", [8, 32])
def test_kernel_softmax_weights_are_exact_exponentials(head_size):
    """Two keys with scores ``a`` and ``a + x`` and one-hot values: the output's two entries
    are in the ratio exp(x), for x down to -80, and even when every score is far below zero
    (``a = -300``, which a running maximum started at 0 instead of -inf would get wrong)."""
    spec = spec_for(head_size=head_size, heads=(1, 1), block_size=4)
    impl = CpuAttentionBackend.get_impl_cls()(1, head_size, 1.0, 1, spec)
    builder = CpuAttentionBackend.get_builder_cls()(spec, torch.device("cpu"))
    xs = [-80.0, -40.0, -17.5, -3.0, -1.0, -0.3, -1e-3, 0.0]
    n = len(xs) * 2
    cache = torch.zeros(CpuAttentionBackend.get_kv_cache_shape(n, 4, 1, head_size))
    table = torch.arange(n, dtype=torch.int32).view(-1, 1)
    for a in (0.0, -300.0):
        # Request i: key 0 cached in block i, key 1 (the decode token) written by the step.
        k0 = torch.zeros(n, 1, head_size)
        k0[:, 0, 0] = a
        v0 = torch.zeros(n, 1, head_size)
        v0[:, 0, 1] = 1.0
        impl.write_kv_cache(cache, k0, v0, torch.arange(n) * 4)
        k1 = torch.zeros(n, 1, head_size)
        k1[:, 0, 0] = torch.tensor([a + x for x in xs] * 2)
        v1 = torch.zeros(n, 1, head_size)
        v1[:, 0, 2] = 1.0
        q = torch.zeros(n, 1, head_size)
        q[:, 0, 0] = 1.0
        common = CommonAttentionMetadata(
            query_start_loc=torch.arange(n + 1, dtype=torch.int32),
            query_start_loc_cpu=torch.arange(n + 1, dtype=torch.int32),
            seq_lens=torch.full((n,), 2, dtype=torch.int32),
            seq_lens_cpu=torch.full((n,), 2, dtype=torch.int32),
            num_computed_tokens_cpu=torch.ones(n, dtype=torch.int32), block_table=table,
            slot_mapping=torch.arange(n) * 4 + 1, num_reqs=n, num_actual_tokens=n,
            max_query_len=1, max_seq_len=2)
        out = impl.forward(q, k1, v1, cache, builder.build(common)).double()[:, 0]
        ratio = out[:, 2] / out[:, 1]
        expected = torch.exp(k1[:, 0, 0].double() - a)  # of the float32 scores as stored
        # float32 rounding near 0; the exponential's reduction loses a little far below it.
        tol = torch.where(torch.tensor(xs * 2) > -1, 5e-7, 5e-6)
        assert ((ratio / expected - 1).abs() <= tol).all(), (a, ratio / expected - 1)


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


def test_a_damaged_cached_kernel_is_rebuilt(fresh_build):
    path = compiler.load_kernel().path
    # A new file in its place (writing into the old one would corrupt the library this
    # process has mapped).
    path.unlink()
    path.write_bytes(b"not a shared library")
    compiler.load_kernel.cache_clear()
    assert compiler.load_kernel().path == path and path.stat().st_size > 1000


def test_compiler_wrappers_in_cc_are_kept(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", "env cc")  # as with CC="ccache gcc"
    assert compiler.find_compiler()[1:] == ["cc"]
    assert compiler.load_kernel().path.exists()


def test_unwritable_cache_falls_back_to_a_temporary_folder(tmp_path, monkeypatch):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.delenv("HITCHLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # cannot hold a folder
    monkeypatch.setattr(compiler.tempfile, "tempdir", str(tmp_path / "tmp"))
    assert compiler._writable_cache_dir().is_relative_to(tmp_path / "tmp")
    monkeypatch.setenv("HITCHLLM_CACHE_DIR", str(blocker))  # chosen explicitly: no fallback
    with pytest.raises(compiler.KernelBuildError, match="set HITCHLLM_CACHE_DIR"):
        compiler._writable_cache_dir()


def test_build_errors_quote_the_compiler_not_the_linker_driver():
    stderr = ("/usr/bin/ld: cannot find -lfoo: No such file or directory\n"
              "collect2: error: ld returned 1 exit status\n")
    assert compiler._first_error(stderr).startswith("/usr/bin/ld: cannot find -lfoo")
    stderr = "k.c:3:1: error: expected ';'\ncollect2: error: ld returned 1 exit status\n"
    assert compiler._first_error(stderr) == "k.c:3:1: error: expected ';'"


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
