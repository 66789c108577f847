"""FLASHINFER_MLA: FlashInfer's paged MLA wrapper behind the MLA attention interface.

On the CPU (FlashInfer is a GPU package, not installed here): what ``validate`` says (not
installed, no CUDA device, a broken install, standard layers, unsupported dtypes and dims),
clean failures when forced, the plan inputs of a batch against a hand-computed example, and the
whole impl and an engine against TORCH_MLA through a stand-in wrapper that implements
FlashInfer's documented semantics in PyTorch (``flashinfer_mla_stand_in``). On the GPU (marked
``gpu``, skipped without CUDA or flashinfer): the real kernel against TORCH_MLA over a paged
cache with shuffled blocks (prompts, chunks over a cached prefix, decodes), and an engine's
greedy tokens equal to TRITON_MLA's on a tiny DeepSeek-V2 with DeepSeek's 512 + 64 latent.
"""

from __future__ import annotations

import importlib.util

import flashinfer_mla_stand_in as stand_in
import numpy as np
import pytest
import torch
from mla_checkpoints import build_tiny_deepseek
from test_models_hf_parity import greedy, mixed_prompts, run

pytest.importorskip("hitchllm_attention_mla")

import hitchllm_attention_mla.flashinfer_mla as fi_mla
from hitchllm import LLM
from hitchllm.attention import AttentionSpec, CommonAttentionMetadata
from hitchllm.attention.selector import (
    AttentionBackendError,
    discover_backends,
    rank_backends,
)
from hitchllm.layers import ColumnParallelLinear
from hitchllm_attention_mla import FlashInferMLABackend, MLADims, TorchMLABackend
from hitchllm_attention_mla.ranking import MLA_BACKEND_PRIORITY

FLASHINFER_INSTALLED = importlib.util.find_spec("flashinfer") is not None
# DeepSeek's latent (FlashInfer's only), few small heads for the CPU.
DIMS = MLADims(num_heads=4, kv_lora_rank=512, qk_nope_head_dim=16, qk_rope_head_dim=64,
               v_head_dim=12)
# (tokens cached before the step, new tokens): a prompt, a chunk over a cached prefix, decodes.
MIXED = [(0, 6), (9, 3), (10, 1), (4, 1)]
DECODES = [(7, 1), (1, 1), (12, 1)]
# A tiny DeepSeek-V2 with FlashInfer's latent; 16 heads, as FlashInfer's own tests use.
FI_MODEL = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16, v_head_dim=16,
                num_attention_heads=16, num_key_value_heads=16)


def mla_spec(device="cuda", dtype=torch.bfloat16, head_size=576, capability=(9, 0),
             **fields) -> AttentionSpec:
    fields = {"kv_cache_dtype": dtype, "block_size": 16, "use_mla": True, **fields}
    return AttentionSpec(device_type=device, dtype=dtype, head_size=head_size, num_heads=4,
                         num_kv_heads=1,
                         device_capability=capability if device == "cuda" else None, **fields)


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """The stand-in installed as the ``flashinfer`` package (``installed(broken=True)``: one
    that fails to import)."""
    if FLASHINFER_INSTALLED:
        pytest.skip("the real flashinfer is installed")

    def install(broken=False):
        stand_in.install_stand_in(tmp_path / "site", broken)
        monkeypatch.syspath_prepend(str(tmp_path / "site"))

    yield install
    stand_in.remove_stand_in()


@pytest.fixture(scope="module")
def fi_deepseek(tmp_path_factory):
    return build_tiny_deepseek(tmp_path_factory.mktemp("v2-fi"), "DeepseekV2ForCausalLM",
                               seed=5, **FI_MODEL)


# ---- CPU: registration, ranking, refusals ------------------------------------------------


def test_registered_with_the_mla_plugin_and_ranked_by_the_table():
    found = {backend.name: (backend, info) for backend, info in discover_backends()}
    mla = {name: backend for name, (backend, _) in found.items() if name.endswith("_MLA")}
    assert set(mla) == set(MLA_BACKEND_PRIORITY)
    assert found["FLASHINFER_MLA"][1].distribution == "hitchllm-attention-mla"
    for name, backend in mla.items():
        assert backend.priority == MLA_BACKEND_PRIORITY[name], name


def test_auto_mode_orders_the_valid_mla_backends_by_the_table(installed):
    """On a (described) Hopper with bf16, all three MLA backends are valid; auto mode lists
    them in the table's order."""
    installed()
    ranked = [c.name for c in rank_backends(mla_spec()) if c.valid]
    assert ranked == sorted(MLA_BACKEND_PRIORITY, key=MLA_BACKEND_PRIORITY.get, reverse=True)


@pytest.mark.skipif(FLASHINFER_INSTALLED, reason="checks a machine without flashinfer")
def test_refused_without_flashinfer_with_the_install_command():
    [reason] = FlashInferMLABackend.validate(mla_spec())
    assert "flashinfer is not installed" in reason
    assert "pip install 'hitchllm-attention-mla[flashinfer]'" in reason


def test_refused_on_cpu_and_with_a_broken_install(installed):
    installed()
    assert FlashInferMLABackend.validate(mla_spec()) == []
    [cpu] = FlashInferMLABackend.validate(mla_spec("cpu", torch.float32))
    assert "no CUDA device" in cpu and "'cpu'" in cpu
    stand_in.remove_stand_in()
    installed(broken=True)
    [broken] = FlashInferMLABackend.validate(mla_spec())
    assert "cannot be imported (ImportError: libflashinfer.so: undefined symbol" in broken
    assert "hitchllm-attention-mla[flashinfer]" in broken


def test_validate_names_everything_it_cannot_serve(installed):
    installed()
    bad = mla_spec(dtype=torch.float32, head_size=40, capability=(7, 5),
                   kv_cache_dtype=torch.float8_e4m3fn, logits_soft_cap=30.0)
    reasons = " | ".join(FlashInferMLABackend.validate(bad))
    for part in ("compute capability 7.5 is below 8.0", "dtype torch.float32 is not supported",
                 "KV-cache dtype torch.float8_e4m3fn", "latent width 40 is not supported",
                 "512 + qk_rope_head_dim 64 = 576", "soft-capping"):
        assert part in reasons, part


def test_standard_layers_are_refused(installed):
    """With or without flashinfer, a model without MLA is named as the reason."""
    llama = mla_spec(head_size=128, use_mla=False)
    without = FlashInferMLABackend.validate(llama)
    assert any("multi-head latent attention" in r for r in without)
    assert any("flashinfer is not installed" in r for r in without)
    installed()
    [reason] = FlashInferMLABackend.validate(llama)
    assert "multi-head latent attention (DeepSeek-V2/V3) only" in reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine")
def test_forcing_it_on_cpu_through_vllm_env_fails_with_the_reason(fi_deepseek, monkeypatch):
    monkeypatch.delenv("HITCHLLM_ATTENTION_BACKEND")
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER_MLA")
    expected = "flashinfer is not installed" if not FLASHINFER_INSTALLED else "no CUDA device"
    with pytest.raises(AttentionBackendError,
                       match=rf"FLASHINFER_MLA \(from hitchllm-attention-mla\) was forced.*"
                             rf"{expected}"):
        LLM(fi_deepseek)


def test_forcing_it_on_llama_is_refused(llama_path):
    with pytest.raises(AttentionBackendError,
                       match="FLASHINFER_MLA.*multi-head latent attention.*standard attention"):
        LLM(llama_path, attention_backend="FLASHINFER_MLA")


def test_other_latent_splits_are_refused_when_the_layer_binds(installed):
    installed()
    dims = MLADims(num_heads=4, kv_lora_rank=544, qk_nope_head_dim=16, qk_rope_head_dim=32,
                   v_head_dim=12)  # 576 wide, as validate checks, but not 512 + 64
    kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, dims.num_heads * 28)
    impl = FlashInferMLABackend.get_impl_cls()(4, 576, 0.3, 1, mla_spec())
    with pytest.raises(ValueError, match="kv_lora_rank 512 and qk_rope_head_dim 64.*544 and 32"):
        impl.attach(dims, kv_b_proj)


# ---- CPU: plan inputs ----------------------------------------------------------------------


def test_page_lists_of_a_batch_by_hand():
    table = np.array([[7, 3, 0, 0], [1, 9, 4, 0], [2, 5, 8, 6], [11, 10, 0, 0]], dtype=np.int32)
    indptr, indices = fi_mla.mla_page_lists(table, np.array([6, 12, 13, 5]), block_size=4)
    assert indptr.tolist() == [0, 2, 5, 9, 11]
    assert indices.tolist() == [7, 3, 1, 9, 4, 2, 5, 8, 6, 11, 10]
    assert indptr.dtype == indices.dtype == np.int32


class Step:
    """One step over a paged latent cache with shuffled blocks: ``requests`` as (cached, new)
    token counts, each request's cached latents written, the new ones and the queries drawn."""

    def __init__(self, requests, dims=DIMS, block=4, dtype=torch.float32, device="cpu",
                 padding=0, seed=0):
        gen = torch.Generator().manual_seed(seed)
        cols = max(-(-(c + n) // block) for c, n in requests)
        num_blocks = len(requests) * cols + 4
        self.cache = torch.zeros(TorchMLABackend.get_kv_cache_shape(
            num_blocks, block, 1, dims.latent_width), dtype=dtype, device=device)
        perm = torch.randperm(num_blocks, generator=gen)[: len(requests) * cols]
        table = perm.view(len(requests), cols).int()
        slots = [table[i, torch.arange(c + n) // block].long() * block
                 + torch.arange(c + n) % block for i, (c, n) in enumerate(requests)]
        latents = [torch.randn(c + n, dims.latent_width, generator=gen) for c, n in requests]
        for s, lat, (c, _) in zip(slots, latents, requests):
            TorchMLABackend.get_impl_cls().write_latents(self.cache, lat[:c].to(self.cache),
                                                         s[:c].to(device))
        new_lens = torch.tensor([n for _, n in requests], dtype=torch.int32)
        cached = torch.tensor([c for c, _ in requests], dtype=torch.int32)
        qsl = torch.cat((torch.zeros(1, dtype=torch.int32), new_lens.cumsum(0).int()))
        tokens = int(qsl[-1])
        slot_mapping = torch.cat([s[c:] for s, (c, _) in zip(slots, requests)]
                                 + [torch.full((padding,), -1)])
        self.common = CommonAttentionMetadata(
            query_start_loc=qsl.to(device), query_start_loc_cpu=qsl,
            seq_lens=(cached + new_lens).to(device), seq_lens_cpu=cached + new_lens,
            num_computed_tokens_cpu=cached, block_table=table.to(device),
            block_table_cpu=table, slot_mapping=slot_mapping.to(device),
            num_reqs=len(requests), num_actual_tokens=tokens,
            max_query_len=int(new_lens.max()), max_seq_len=int((cached + new_lens).max()))
        self.table = table
        rows = tokens + padding
        self.query = torch.randn(rows, dims.num_heads, dims.qk_head_dim,
                                 generator=gen).to(device, dtype)
        self.new = torch.cat([lat[c:] for lat, (c, _) in zip(latents, requests)]
                             + [torch.randn(padding, dims.latent_width, generator=gen)]
                             ).to(device, dtype)


def test_plan_inputs_of_a_mixed_batch_by_hand(installed):
    installed()
    step = Step(MIXED)
    builder = FlashInferMLABackend.get_builder_cls()(mla_spec("cpu", block_size=4),
                                                     torch.device("cpu"))
    meta = builder.build(step.common)
    [wrapper] = stand_in.WRAPPERS
    assert meta.wrapper is wrapper and meta.num_tokens == 11
    plan = wrapper.plans[-1]
    t = step.table.tolist()
    # Context lengths 6, 12, 11, 5 over blocks of 4: 2, 3, 3 and 2 pages.
    assert plan["qo_indptr"].tolist() == [0, 6, 9, 10, 11]
    assert plan["kv_indptr"].tolist() == [0, 2, 5, 8, 10]
    assert plan["kv_indices"].tolist() == t[0][:2] + t[1][:3] + t[2][:3] + t[3][:2]
    assert plan["kv_len_arr"].tolist() == [6, 12, 11, 5]
    assert {k: plan[k] for k in ("num_heads", "head_dim_ckv", "head_dim_kpe", "page_size",
                                 "causal", "sm_scale", "q_data_type", "kv_data_type")} == dict(
        num_heads=4, head_dim_ckv=512, head_dim_kpe=64, page_size=4, causal=True,
        sm_scale=1.0, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    # A decode step: planned without the (there meaningless) causal mask, on the same wrapper.
    decode = Step(DECODES, seed=1)
    assert builder.build(decode.common).wrapper is wrapper
    assert wrapper.plans[-1]["causal"] is False
    assert wrapper.plans[-1]["qo_indptr"].tolist() == [0, 1, 2, 3]
    assert wrapper.plans[-1]["kv_len_arr"].tolist() == [8, 2, 13]


def test_empty_steps_plan_nothing_and_graph_batches_are_refused(installed):
    installed()
    builder = FlashInferMLABackend.get_builder_cls()(mla_spec("cpu", block_size=4),
                                                     torch.device("cpu"))
    common = Step(DECODES).common
    common.num_actual_tokens = 0
    assert builder.build(common).wrapper is None
    assert not stand_in.WRAPPERS[0].plans
    common.cuda_graph = True
    with pytest.raises(ValueError, match="never captured into CUDA graphs"):
        builder.build(common)
    assert FlashInferMLABackend.cuda_graph_support.value == "never"


# ---- CPU: the impl through the stand-in, against TORCH_MLA ---------------------------------


def up_weight(dims, seed=0):
    """A random ``kv_b_proj`` weight [heads * (qk_nope + v), kv_lora_rank]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(dims.num_heads * (dims.qk_nope_head_dim + dims.v_head_dim),
                       dims.kv_lora_rank, generator=gen) * 0.05


def make_impls(dims, weight, scale=0.3, block=4):
    """A FLASHINFER_MLA and a TORCH_MLA impl of one MLA layer whose ``kv_b_proj`` has
    ``weight`` (its dtype and device are the layer's), each with its metadata builder for
    blocks of ``block`` tokens."""
    dtype, device = weight.dtype, weight.device
    kv_b_proj = ColumnParallelLinear(dims.kv_lora_rank, weight.shape[0]).to(device, dtype)
    with torch.no_grad():
        kv_b_proj.weight.copy_(weight)
    impls = {}
    for backend in (FlashInferMLABackend, TorchMLABackend):
        spec = AttentionSpec.for_device(
            device, dtype=dtype, kv_cache_dtype=dtype, head_size=576,
            num_heads=dims.num_heads, num_kv_heads=1, block_size=block, use_mla=True)
        impl = backend.get_impl_cls()(dims.num_heads, 576, scale, 1, spec)
        impl.attach(dims, kv_b_proj)
        impls[backend.name] = (impl, backend.get_builder_cls()(spec, device))
    return impls


def run_step(impl, builder, step):
    cache = step.cache.clone()
    meta = builder.build(step.common)
    out = impl.forward(step.query, step.new[:, None], None, cache, meta)
    return out, cache


@pytest.mark.parametrize("requests", [MIXED, DECODES], ids=["mixed", "decodes"])
def test_impl_equals_torch_mla_through_the_stand_in(installed, requests):
    """Absorbed query, the layer's scale folded into it (the plan's is 1), the latent views,
    W_UV after attention, padding rows (slot -1) zero and written to the spare block."""
    installed()
    impls = make_impls(DIMS, up_weight(DIMS))
    step = Step(requests, padding=2)
    got, got_cache = run_step(*impls["FLASHINFER_MLA"], step)
    want, want_cache = run_step(*impls["TORCH_MLA"], step)
    n = step.common.num_actual_tokens
    assert got.shape == (n + 2, DIMS.num_heads, DIMS.v_head_dim)
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-5, atol=1e-5)
    assert not got[n:].any()
    torch.testing.assert_close(got_cache, want_cache, rtol=0, atol=0)
    assert want.abs().max() > 0.05  # not a vacuous comparison


def test_engine_on_the_stand_in_equals_torch_mla(installed, fi_deepseek, monkeypatch):
    """The builder fed by the engine's real step buffers (block_table_cpu, chunked prefill
    over a prefix-cached system prompt, decodes): greedy tokens equal TORCH_MLA's, fp32 on the
    CPU (validate is told the stand-in serves both)."""
    installed()
    monkeypatch.setattr(fi_mla, "flashinfer_mla_problem", lambda device_type: None)
    monkeypatch.setattr(fi_mla, "DTYPES", (torch.float32,))
    system = mixed_prompts(11, lengths=(13,))[0]
    prompts = [[*system, 7, 8], [*system, 10], *mixed_prompts(5, lengths=(1, 9))]
    kwargs = dict(block_size=4, max_num_batched_tokens=8)
    expected = run(LLM(fi_deepseek, attention_backend="TORCH_MLA", **kwargs), prompts)
    llm = LLM(fi_deepseek, attention_backend="FLASHINFER_MLA", **kwargs)
    assert llm.engine.attention_backend is FlashInferMLABackend
    assert run(llm, prompts[:1]) == expected[:1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], greedy(),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected[1:]
    assert outs[0].num_cached_tokens == 12
    assert any(p["causal"] for w in stand_in.WRAPPERS for p in w.plans)


# ---- GPU -------------------------------------------------------------------------------------


needs_flashinfer = pytest.mark.skipif(not FLASHINFER_INSTALLED, reason="needs flashinfer")
GPU_DIMS = {"16-heads": MLADims(16, 512, 128, 64, 128), "128-heads": MLADims(128, 512, 128, 64,
                                                                            128)}
GPU_STEPS = {
    "mixed": [(0, 300), (700, 129), (2047, 1), (33, 1), (0, 1)],
    "decodes": [(2047, 1)] * 16 + [(5, 1), (900, 1)],
}


@pytest.mark.gpu
@needs_flashinfer
@pytest.mark.parametrize("block", [16, 64])
@pytest.mark.parametrize("steps", sorted(GPU_STEPS))
@pytest.mark.parametrize("heads", sorted(GPU_DIMS))
def test_gpu_kernel_equals_torch_mla(heads, steps, block):
    """The real kernel, bf16, against TORCH_MLA on the same cache in float32."""
    dims = GPU_DIMS[heads]
    step = Step(GPU_STEPS[steps], dims=dims, block=block, dtype=torch.bfloat16, device="cuda",
                padding=3)
    weight = up_weight(dims).to("cuda", torch.bfloat16)
    impls = make_impls(dims, weight, 192**-0.5, block)
    got, got_cache = run_step(*impls["FLASHINFER_MLA"], step)
    # The reference: the same (bf16-rounded) values, in float32.
    step.cache, step.query, step.new = step.cache.float(), step.query.float(), step.new.float()
    impls = make_impls(dims, weight.float(), 192**-0.5, block)
    want, want_cache = run_step(*impls["TORCH_MLA"], step)
    n = step.common.num_actual_tokens
    error = ((got[:n].float() - want[:n]).norm() / want[:n].norm()).item()
    assert error < 2e-2, error
    assert not got[n:].any()
    torch.testing.assert_close(got_cache.float(), want_cache, rtol=0, atol=0)


@pytest.mark.gpu
@needs_flashinfer
def test_gpu_engine_greedy_tokens_equal_triton_mla(fi_deepseek):
    """Tiny DeepSeek-V2 with DeepSeek's latent (512 + 64), fp16, both backends forced: mixed
    batches, chunked prefill over a prefix-cached system prompt, decodes."""
    system = mixed_prompts(11, lengths=(40,))[0]
    prompts = [[*system, 7, 8], [*system, 10], *mixed_prompts(5, lengths=(1, 9, 30, 70))]
    tokens = {}
    for backend in ("TRITON_MLA", "FLASHINFER_MLA"):
        llm = LLM(fi_deepseek, device="cuda", dtype="float16", block_size=16,
                  max_num_batched_tokens=32, attention_backend=backend)
        assert llm.engine.attention_backend.name == backend
        tokens[backend] = run(llm, prompts, max_tokens=12)
        del llm
        torch.cuda.empty_cache()
    assert tokens["FLASHINFER_MLA"] == tokens["TRITON_MLA"]
