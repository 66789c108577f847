"""FLASH_ATTN and FLASHINFER: the vendor-library backends.

On CPU (CI, where neither library is installed): registration, what ``validate`` says with
the library missing or unable to serve, clean failure when forced, FlashInfer's page lists,
and the FlashAttention-2 call path against a float64 reference through a stand-in module that
implements FlashAttention-2's documented paged semantics in PyTorch (the real one cannot be
installed on the GPU machine). On the GPU machine (marked ``gpu``): each backend against the
float64 reference over paged caches with permuted blocks, engine tokens against TORCH, and
CUDA-graph replay equal to eager.
"""

from __future__ import annotations

import math
import sys
import types

import numpy as np
import pytest
import torch
from attention_reference import make_batch, reference_attention
from test_models_hf_parity import mixed_prompts, run, run_staggered

pytest.importorskip("hitchllm_attention_flash")
pytest.importorskip("hitchllm_attention_flashinfer")

import hitchllm_attention_flash.backend as flash_backend
import hitchllm_attention_flashinfer.backend as fi_backend
from hitchllm import LLM, SamplingParams
from hitchllm.attention import (
    AttentionSpec,
    CommonAttentionMetadata,
    pad_rows,
    write_nhd,
)
from hitchllm.attention.selector import AttentionBackendError, discover_backends
from hitchllm.tiny_model import build_tiny_checkpoint
from hitchllm_attention_flash import FlashAttentionBackend
from hitchllm_attention_flashinfer import FlashInferAttentionBackend

BACKENDS = {"FLASH_ATTN": FlashAttentionBackend, "FLASHINFER": FlashInferAttentionBackend}
CASES = {
    "prefill": ([0, 0, 0], [5, 17, 1]),
    "chunked-prefill-over-cached-prefix": ([8, 13], [7, 4]),
    "decode": ([1, 9, 31, 16], [1, 1, 1, 1]),
    "mixed": ([0, 12, 40, 3], [9, 1, 6, 1]),
}
GPU_CASES = {
    "prefill": ([0] * 4, [512, 300, 77, 1000]),
    "chunked-prefill-and-decode": ([1500, 2048, 0, 700], [512, 1, 333, 1]),
    "decode": ([2047] * 32, [1] * 32),
    "partial-blocks": ([5, 17, 0, 31], [3, 1, 9, 1]),
}


def spec_for(device="cuda", dtype=torch.bfloat16, head_size=128, heads=(32, 8), block_size=16,
             capability=(9, 0), **extra) -> AttentionSpec:
    return AttentionSpec(device_type=device, dtype=dtype, kv_cache_dtype=dtype,
                         head_size=head_size, num_heads=heads[0], num_kv_heads=heads[1],
                         block_size=block_size,
                         device_capability=capability if device == "cuda" else None, **extra)


def run_backend(backend, context_lens, query_lens, num_heads, num_kv_heads, head_size=16,
                block_size=4, dtype=torch.float32, device="cpu", sliding_window=None,
                soft_cap=None, scale=None, seed=0):
    """One step of ``backend`` over a random paged cache, and the float64 reference."""
    dev = torch.device(device)
    spec = AttentionSpec.for_device(dev, dtype=dtype, kv_cache_dtype=dtype, head_size=head_size,
                                    num_heads=num_heads, num_kv_heads=num_kv_heads,
                                    block_size=block_size, sliding_window=sliding_window,
                                    logits_soft_cap=soft_cap)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 8
    cache = torch.zeros(backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads,
                                                   head_size), dtype=dtype, device=device)

    def write(slots, k, v):
        write_nhd(cache, k, v, slots)

    batch = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_size,
                       block_size, num_blocks, cache, dtype, seed=seed, write_context=write)
    table = batch.common.block_table.cpu()
    batch.common.block_table_cpu = table[:, : -(-batch.common.max_seq_len // block_size)]
    scale = scale or head_size**-0.5
    meta = backend.get_builder_cls()(spec, dev).build(batch.common)
    impl = backend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, spec)
    out = impl.forward(batch.query, batch.key, batch.value, cache, meta)
    return out, reference_attention(batch, scale, sliding_window, soft_cap, dtype)


# ---- CPU: registration and validation ------------------------------------------------------


@pytest.fixture
def libraries(monkeypatch):
    """Pretend which libraries are installed: ``libraries(fi=..., fa4=..., fa2=...)``."""

    def set_installed(fi=False, fa4=False, fa2=False):
        monkeypatch.setattr(fi_backend, "_flashinfer_installed", lambda: fi)
        monkeypatch.setattr(flash_backend, "fa4_installed", lambda: fa4)
        monkeypatch.setattr(flash_backend, "fa2_installed", lambda: fa2)

    return set_installed


def test_both_plugins_register_their_backend_from_their_distribution():
    found = {backend.name: info for backend, info in discover_backends()}
    assert found["FLASH_ATTN"].distribution == "hitchllm-attention-flash"
    assert found["FLASHINFER"].distribution == "hitchllm-attention-flashinfer"
    # Ranked by measured end-to-end throughput on an H100 (benchmarks/RESULTS.md): TRITON_ATTN,
    # then FLASHINFER, then FLASH_ATTN, all above the core's TORCH.
    triton = 100  # hitchllm-attention-triton's priority
    assert triton > FlashInferAttentionBackend.priority > FlashAttentionBackend.priority > 0


def test_missing_libraries_are_reported_with_the_pip_command(libraries):
    libraries()
    spec = spec_for()
    [fi] = FlashInferAttentionBackend.validate(spec)
    assert "flashinfer is not installed" in fi and "hitchllm-attention-flashinfer[kernels]" in fi
    [fa] = FlashAttentionBackend.validate(spec)
    assert "flash-attn is not installed" in fa and "hitchllm-attention-flash[kernels]" in fa


def test_validate_names_everything_it_cannot_serve(libraries):
    libraries(fi=True, fa4=True)
    assert FlashInferAttentionBackend.validate(spec_for()) == []
    assert FlashAttentionBackend.validate(spec_for()) == []
    assert "no CUDA device" in FlashInferAttentionBackend.validate(spec_for("cpu"))[0]
    assert "no CUDA device" in FlashAttentionBackend.validate(spec_for("cpu"))[0]
    bad = spec_for(dtype=torch.float32, head_size=96, heads=(12, 8), capability=(7, 5))
    fi = " | ".join(FlashInferAttentionBackend.validate(bad))
    for part in ("compute capability 7.5", "dtype torch.float32", "head size 96",
                 "12 query heads are not a multiple of 8"):
        assert part in fi
    mla = FlashInferAttentionBackend.validate(spec_for(use_mla=True))
    assert any("MLA" in r for r in mla)
    # FlashAttention-4 alone on an Ampere card, and head sizes it cannot take.
    [ampere] = FlashAttentionBackend.validate(spec_for(capability=(8, 0)))
    assert "Hopper and Blackwell" in ampere and "8.0" in ampere
    assert any("head size 100" in r for r in FlashAttentionBackend.validate(
        spec_for(head_size=100)))
    assert any("head size 192" in r for r in FlashAttentionBackend.validate(
        spec_for(head_size=192, capability=(10, 0))))


def test_flash_attention_2_asks_for_blocks_of_256(libraries):
    libraries(fa2=True)
    [reason] = FlashAttentionBackend.validate(spec_for(capability=(8, 0), block_size=16))
    assert "multiple of 256" in reason and "--block-size 256" in reason
    assert FlashAttentionBackend.validate(spec_for(capability=(8, 0), block_size=256)) == []
    # With both installed, Hopper takes FlashAttention-4 (any block size), Ampere -2.
    libraries(fa4=True, fa2=True)
    assert flash_backend.choose_version(spec_for(capability=(9, 0))) == 4
    assert flash_backend.choose_version(spec_for(capability=(8, 6))) == 2


@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("how", ["argument", "env"])
def test_forcing_an_unavailable_backend_fails_cleanly(llama_path, monkeypatch, name, how):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only machine")
    kwargs = {}
    if how == "argument":
        kwargs["attention_backend"] = name
    else:
        monkeypatch.delenv("HITCHLLM_ATTENTION_BACKEND")
        monkeypatch.setenv("VLLM_ATTENTION_BACKEND", name)
    with pytest.raises(AttentionBackendError, match=rf"{name}.*(not installed|no CUDA)"):
        LLM(llama_path, **kwargs)
    # Nothing is left half-built: the next engine in the process starts and generates.
    monkeypatch.setenv("HITCHLLM_ATTENTION_BACKEND", "TORCH")
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    out = LLM(llama_path).generate("def", SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


# ---- CPU: FlashInfer's page lists ---------------------------------------------------------


def test_page_lists_follow_the_block_table_and_pad_graph_requests():
    rng = np.random.default_rng(0)
    block_size, cols = 16, 9
    seq = np.array([1, 16, 17, 140, 33], dtype=np.int32)
    table = rng.permutation(200)[: len(seq) * cols].reshape(len(seq), cols).astype(np.int32)
    padded_seq = np.concatenate([seq, np.zeros(3, dtype=np.int32)])  # 3 padding requests
    indptr, indices, last = fi_backend.page_lists(table, padded_seq, block_size)
    for i, s in enumerate(seq):
        pages = indices[indptr[i] : indptr[i + 1]]
        assert list(pages) == list(table[i, : math.ceil(s / block_size)])
        assert (len(pages) - 1) * block_size + last[i] == s
    assert list(np.diff(indptr)[len(seq) :]) == [1, 1, 1] and list(last[len(seq) :]) == [1] * 3
    assert indices.dtype == indptr.dtype == last.dtype == np.int32


# ---- CPU: the FlashAttention-2 call path through a stand-in module --------------------------


def _fa2_varlen_reference(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, softmax_scale=None, causal=False,
                          window_size=(-1, -1), softcap=0.0, block_table=None):
    """FlashAttention-2's documented semantics for paged varlen attention: request i's
    queries are rows cu_seqlens_q[i]:cu_seqlens_q[i+1]; its keys are the first
    cu_seqlens_k[i+1] - cu_seqlens_k[i] tokens of the pages block_table[i]; the causal mask is
    aligned to the bottom right; window_size = (left, right) in tokens, -1 = unbounded."""
    assert block_table is not None and block_table.dtype == torch.int32
    assert k_cache.shape[1] % 256 == 0, "FlashAttention-2's paged KV needs pages of 256k"
    out = torch.empty_like(q)
    page = k_cache.shape[1]
    for i in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        kv_len = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        assert q1 - q0 <= max_seqlen_q and kv_len <= max_seqlen_k
        pages = block_table[i, : -(-kv_len // page)].long()
        k = k_cache[pages].flatten(0, 1)[:kv_len].double()
        v = v_cache[pages].flatten(0, 1)[:kv_len].double()
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), k) * softmax_scale
        if softcap:
            s = softcap * torch.tanh(s / softcap)
        qpos = torch.arange(kv_len - (q1 - q0), kv_len)[:, None]
        kpos = torch.arange(kv_len)[None, :]
        allowed = torch.ones(q1 - q0, kv_len, dtype=torch.bool)
        if causal:
            allowed &= kpos <= qpos
        if window_size[0] >= 0:
            allowed &= qpos - kpos <= window_size[0]
        out[q0:q1] = torch.einsum("hqk,khd->qhd", s.masked_fill(~allowed, -math.inf)
                                  .softmax(-1), v).to(q.dtype)
    return out


@pytest.fixture
def fake_fa2(monkeypatch, libraries):
    libraries(fa2=True)
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _fa2_varlen_reference
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(flash_backend, "choose_version", lambda spec: 2)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["mha", "gqa4"])
def test_flash_attention_2_path_matches_reference(fake_fa2, case, heads):
    out, ref = run_backend(FlashAttentionBackend, *CASES[case], *heads, block_size=256)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_flash_attention_2_path_window_soft_cap_and_scale(fake_fa2):
    out, ref = run_backend(FlashAttentionBackend, [300, 0], [5, 40], 4, 2, block_size=256,
                           sliding_window=7, soft_cap=5.0, scale=0.3)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_flash_attention_2_graph_batches_keep_their_buffer(fake_fa2):
    """The cumulative lengths a captured graph reads stay at one address, whatever eager
    batches (larger than any graph) come in between."""
    spec = spec_for("cpu", dtype=torch.float32, heads=(4, 2), head_size=16, block_size=256)
    builder = FlashAttentionBackend.get_builder_cls()(spec, torch.device("cpu"))

    def build(seq_lens, cuda_graph):
        n = len(seq_lens)
        seq = torch.tensor(seq_lens, dtype=torch.int32)
        qsl = torch.arange(n + 1, dtype=torch.int32)
        common = CommonAttentionMetadata(
            query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq, seq_lens_cpu=seq,
            num_computed_tokens_cpu=seq - 1, block_table=torch.zeros(n, 1, dtype=torch.int32),
            slot_mapping=torch.zeros(n, dtype=torch.int64), num_reqs=n, num_actual_tokens=n,
            max_query_len=1, max_seq_len=max(seq_lens), cuda_graph=cuda_graph)
        return builder.build(common).cu_seq_lens

    captured = build([0] * 4, cuda_graph=True)  # capture: the largest size first
    eager = build(list(range(1, 13)), cuda_graph=False)
    assert eager.tolist() == [0, *np.cumsum(range(1, 13))]
    replay = build([5, 7, 0, 0], cuda_graph=True)
    assert replay.data_ptr() == captured.data_ptr() and replay.tolist() == [0, 5, 12, 12, 12]
    with pytest.raises(RuntimeError, match="largest graph size first"):
        build([1] * 5, cuda_graph=True)


def test_outputs_pad_back_to_the_layer_rows_and_flashinfer_scale_factor():
    out = torch.randn(3, 2, 4)
    assert pad_rows(out, 3) is out  # no copy without padding
    padded = pad_rows(out, 5)
    assert torch.equal(padded[:3], out) and not padded[3:].any()
    spec = spec_for()
    impl_cls = FlashInferAttentionBackend.get_impl_cls()
    assert impl_cls(32, 128, 128**-0.5, 8, spec).q_factor is None
    assert impl_cls(32, 128, 0.1, 8, spec).q_factor == pytest.approx(0.1 * 128**0.5)


def test_nhd_write_skips_padding_into_the_spare_block():
    cache = torch.zeros(FlashAttentionBackend.get_kv_cache_shape(3, 4, 2, 8))
    key, value = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    write_nhd(cache, key, value, torch.tensor([5, -1, 0]))
    flat = cache.view(2, -1, 2, 8)
    torch.testing.assert_close(flat[0, 5], key[0])
    torch.testing.assert_close(flat[1, 0], value[2])
    written = flat[:, :12].abs().sum((0, 2, 3)).nonzero().flatten().tolist()
    assert written == [0, 5]  # the 3 real blocks: only the two real tokens' slots
    torch.testing.assert_close(flat[0, 12], key[1])  # padding: first slot of the spare block


# ---- GPU ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def models64(tmp_path_factory) -> dict[str, str]:
    """Tiny random checkpoints with head size 64 (FlashInfer's smallest)."""
    root = tmp_path_factory.mktemp("head64")
    shape = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2)
    return {
        "Qwen3ForCausalLM": str(build_tiny_checkpoint(root / "qwen3", "Qwen3ForCausalLM",
                                                      head_dim=64, **shape)),
        "LlamaForCausalLM": str(build_tiny_checkpoint(root / "llama", "LlamaForCausalLM",
                                                      **shape)),
    }


def _usable(name: str, **spec_fields) -> None:
    reasons = BACKENDS[name].validate(AttentionSpec.for_device(
        torch.device("cuda"), dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16,
        head_size=128, num_heads=32, num_kv_heads=8, block_size=16, **spec_fields))
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BACKENDS))
@pytest.mark.parametrize("case", sorted(GPU_CASES))
@pytest.mark.parametrize("heads", [(32, 8), (16, 16), (32, 4)])
def test_gpu_matches_float64_reference(name, case, heads):
    _usable(name)
    for block_size in (16, 32):
        out, ref = run_backend(BACKENDS[name], *GPU_CASES[case], *heads, head_size=128,
                               block_size=block_size, dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_gpu_graph_batches_with_padding_requests_replanned(name):
    """CUDA-graph metadata (padding requests with context 0 and slot -1, max_seq_len an upper
    bound) built twice by one builder for the same padded size with different contexts: the
    real requests' outputs match the reference both times."""
    _usable(name)
    backend, dev = BACKENDS[name], torch.device("cuda")
    heads, head_size, block_size, pad_to = (16, 8), 128, 16, 8
    spec = AttentionSpec.for_device(dev, dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16,
                                    head_size=head_size, num_heads=heads[0],
                                    num_kv_heads=heads[1], block_size=block_size)
    builder = backend.get_builder_cls()(spec, dev)
    impl = backend.get_impl_cls()(heads[0], head_size, head_size**-0.5, heads[1], spec)
    for seed, contexts in enumerate(([100, 3, 700, 31, 16], [2047, 1, 64, 500, 9])):
        n = len(contexts)
        cache = torch.zeros(backend.get_kv_cache_shape(200, block_size, heads[1], head_size),
                            dtype=torch.bfloat16, device=dev)
        batch = make_batch(contexts, [1] * n, *heads, head_size, block_size, 200, cache,
                           torch.bfloat16, seed=seed,
                           write_context=lambda sl, k, v, cache=cache: write_nhd(cache, k, v, sl))
        c = batch.common
        pad = pad_to - n
        qsl = torch.arange(pad_to + 1, dtype=torch.int32)
        seq = torch.cat([c.seq_lens_cpu, torch.zeros(pad, dtype=torch.int32)])
        table = torch.cat([c.block_table.cpu(), c.block_table.cpu()[:1].repeat(pad, 1)])
        common = CommonAttentionMetadata(
            query_start_loc=qsl.to(dev), query_start_loc_cpu=qsl, seq_lens=seq.to(dev),
            seq_lens_cpu=seq, num_computed_tokens_cpu=torch.cat(
                [c.num_computed_tokens_cpu, torch.zeros(pad, dtype=torch.int32)]),
            block_table=table.to(dev), block_table_cpu=c.block_table.cpu(),
            slot_mapping=torch.cat([c.slot_mapping, torch.full((pad,), -1, device=dev)]),
            num_reqs=pad_to, num_actual_tokens=pad_to, max_query_len=1, max_seq_len=4096,
            cuda_graph=True)
        pad_q = torch.randn(pad, heads[0], head_size, dtype=torch.bfloat16, device=dev)
        pad_kv = torch.randn(pad, heads[1], head_size, dtype=torch.bfloat16, device=dev)
        out = impl.forward(torch.cat([batch.query, pad_q]), torch.cat([batch.key, pad_kv]),
                           torch.cat([batch.value, pad_kv]), cache, builder.build(common))
        ref = reference_attention(batch, head_size**-0.5, dtype=torch.bfloat16)
        torch.testing.assert_close(out[:n].double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_gpu_head_size_64_window_soft_cap_and_scale(name):
    _usable(name)
    out, ref = run_backend(BACKENDS[name], [700, 0, 90], [1, 300, 40], 16, 4, head_size=64,
                           block_size=16, dtype=torch.bfloat16, device="cuda",
                           sliding_window=128, soft_cap=30.0, scale=0.2)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_gpu_engine_tokens_track_torch_backend(models64, name):
    _usable(name)  # skip, as the kernel tests do, where the library is missing
    path = models64["Qwen3ForCausalLM"]
    prompts = mixed_prompts(6, lengths=(3, 40, 70))
    ref = run(LLM(path, device="cuda", attention_backend="TORCH"), prompts, max_tokens=4)
    got = run(LLM(path, device="cuda", attention_backend=name), prompts, max_tokens=4)
    assert [g[:2] for g in got] == [r[:2] for r in ref]


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_gpu_backends_agree_on_engine_tokens(models64, name):
    """Greedy tokens of a longer run equal TRITON_ATTN's (same dtype, same model)."""
    _usable(name)  # skip, as the kernel tests do, where the library is missing
    path = models64["LlamaForCausalLM"]
    prompts = mixed_prompts(2, lengths=(5, 33, 64, 17))
    base = run(LLM(path, device="cuda", dtype="float16", attention_backend="TRITON_ATTN"),
               prompts, max_tokens=12)
    got = run(LLM(path, device="cuda", dtype="float16", attention_backend=name), prompts,
              max_tokens=12)
    agree = sum(a == b for g, r in zip(got, base) for a, b in zip(g, r))
    assert agree >= 0.9 * sum(len(r) for r in base)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(BACKENDS))
def test_gpu_cuda_graph_replay_equals_eager(models64, name):
    _usable(name)  # skip, as the kernel tests do, where the library is missing
    path = models64["Qwen3ForCausalLM"]
    graphs = LLM(path, device="cuda", attention_backend=name)
    assert graphs.engine.executor.runner.graphs.captured
    eager = LLM(path, device="cuda", attention_backend=name, enforce_eager=True)
    assert run_staggered(graphs) == run_staggered(eager)
