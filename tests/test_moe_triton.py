"""The fused Triton MoE kernel (attention_triton plugin) against a float64 per-token reference
(CPU: Triton's interpreter, float32 and float16; GPU: DeepSeek-V2-Lite shapes in bf16, and
under CUDA graph capture), its expert sort, the plugin's choice of method, and a tiny
Qwen3-MoE engine whose greedy tokens do not change when the kernel replaces PyTorch."""

from __future__ import annotations

import os

import pytest
import torch
from bench_support import load_benchmark
from test_models_hf_parity import mixed_prompts, run

pytest.importorskip("triton")
pytest.importorskip("hitchllm_attention_triton")

from hitchllm import LLM
from hitchllm.layers import FusedMoE, MoEMethod, UnquantizedMoEMethod
from hitchllm.tiny_model import build_tiny_checkpoint
from hitchllm_attention_triton.moe import TritonMoEMethod, fused_moe, moe_align
from hitchllm_attention_triton.plugin import MOE_KERNEL_ENV, hitchllm_model_loaded

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
on_cpu = pytest.mark.skipif(not INTERPRETED, reason="CPU cases run in Triton's interpreter")


def reference_moe(hidden, w13, w2, topk_weights, topk_ids):
    """Float64, one token and one choice at a time."""
    hidden, w13, w2 = hidden.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = w13[e] @ hidden[t]
            act = torch.nn.functional.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(topk_weights[t, j]) * (w2[e] @ act)
    return out


def random_moe(tokens, top_k, experts, hidden, inter, dtype, device="cpu", used=None, seed=0):
    """Inputs; ``used`` experts (default all) are the only ones routed to."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5
    pool = used or experts
    rows = [torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)]
    ids = torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long)
    weights = torch.rand(tokens, top_k, generator=gen)
    return [t.to(device) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def expected_alignment(topk_ids, experts, block_m):
    """Plain-Python sort: per expert its pairs in order, padded to whole blocks."""
    flat = topk_ids.reshape(-1).tolist()
    rows, block_experts = [], []
    for e in range(experts):
        pairs = [i for i, x in enumerate(flat) if x == e]
        if pairs:
            blocks = -(-len(pairs) // block_m)
            rows += pairs + [len(flat)] * (blocks * block_m - len(pairs))
            block_experts += [e] * blocks
    return rows, block_experts


@pytest.mark.parametrize(("tokens", "top_k", "experts", "block_m", "used"),
                         [(1, 1, 8, 16, None), (37, 2, 8, 16, 5), (37, 6, 64, 4, None),
                          (9, 6, 64, 16, 20)])
def test_moe_align_sorts_pairs_into_padded_expert_blocks(tokens, top_k, experts, block_m,
                                                         used):
    *_, ids = random_moe(tokens, top_k, experts, 4, 4, torch.float32, used=used)
    align = moe_align(ids, experts, block_m)
    rows, block_experts = expected_alignment(ids, experts, block_m)
    used_rows = int(align.num_padded)
    assert used_rows == len(rows)
    assert align.sorted_ids[:used_rows].tolist() == rows
    assert align.block_expert[:used_rows // block_m].tolist() == block_experts
    # Fixed size whatever the routing: the rest is padding the kernel never reads.
    assert align.sorted_ids.numel() == -(-(tokens * top_k + experts * (block_m - 1))
                                         // block_m) * block_m
    assert (align.sorted_ids[used_rows:] == tokens * top_k).all()
    same_shape = moe_align(torch.zeros_like(ids), experts, block_m)
    assert same_shape.sorted_ids.shape == align.sorted_ids.shape
    assert same_shape.block_expert.shape == align.block_expert.shape


@on_cpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "top_k", "experts", "used"),
                         [(1, 1, 8, None), (1, 6, 64, None), (37, 2, 8, 5), (37, 6, 64, None),
                          (37, 1, 64, 3)])
def test_fused_moe_matches_float64_reference(tokens, top_k, experts, used, dtype):
    # Hidden 80 and intermediate 40 are not multiples of the kernel's 64-wide tiles.
    x, w13, w2, weights, ids = random_moe(tokens, top_k, experts, 80, 40, dtype, used=used)
    want = reference_moe(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-5 if dtype == torch.float32 else 3e-3
    scale = want.abs().max()
    assert (got.double() - want).abs().max() <= tol * scale


@on_cpu
def test_fused_moe_names_mismatched_shapes():
    x, w13, w2, weights, ids = random_moe(3, 2, 8, 16, 8, torch.float32)
    with pytest.raises(ValueError, match="do not match hidden size"):
        fused_moe(x[:, :8], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="must both be"):
        fused_moe(x, w13, w2, weights[:, :1], ids)
    with pytest.raises(ValueError, match="must share a dtype"):
        fused_moe(x.half(), w13, w2, weights, ids)


@on_cpu
def test_fused_moe_of_an_empty_batch_is_empty():
    x, w13, w2, weights, ids = random_moe(0, 2, 8, 16, 8, torch.float32)
    assert ids.shape == (0, 2)
    assert fused_moe(x, w13, w2, weights, ids).shape == (0, 16)


def moe_model(experts=4):
    return torch.nn.Sequential(FusedMoE(experts, 16, 8))


def test_plugin_installs_the_kernel_only_where_asked(monkeypatch):
    model = moe_model()
    monkeypatch.delenv(MOE_KERNEL_ENV, raising=False)
    hitchllm_model_loaded(model=model, engine_config=None)
    assert type(model[0].moe_method) is UnquantizedMoEMethod  # CPU weights, nothing forced
    monkeypatch.setenv(MOE_KERNEL_ENV, "triton")
    hitchllm_model_loaded(model=model, engine_config=None)
    assert type(model[0].moe_method) is TritonMoEMethod
    monkeypatch.setenv(MOE_KERNEL_ENV, "cutlass")
    with pytest.raises(ValueError, match="HITCHLLM_MOE_KERNEL='cutlass' is not one of"):
        hitchllm_model_loaded(model=moe_model(), engine_config=None)


@pytest.mark.gpu
def test_plugin_installs_the_kernel_by_default_on_a_gpu(monkeypatch):
    monkeypatch.delenv(MOE_KERNEL_ENV, raising=False)
    model = moe_model().cuda()
    hitchllm_model_loaded(model=model, engine_config=None)
    assert type(model[0].moe_method) is TritonMoEMethod
    monkeypatch.setenv(MOE_KERNEL_ENV, "torch")
    model = moe_model().cuda()
    hitchllm_model_loaded(model=model, engine_config=None)
    assert type(model[0].moe_method) is UnquantizedMoEMethod


def test_plugin_leaves_a_quantized_moe_method_alone(monkeypatch):
    class OtherMethod(UnquantizedMoEMethod):
        pass

    monkeypatch.setenv(MOE_KERNEL_ENV, "triton")
    model = torch.nn.Sequential(FusedMoE(4, 16, 8, method=OtherMethod()))
    hitchllm_model_loaded(model=model, engine_config=None)
    assert type(model[0].moe_method) is OtherMethod
    assert isinstance(model[0].moe_method, MoEMethod)


@on_cpu
def test_qwen3_moe_greedy_tokens_equal_the_torch_method(tmp_path, monkeypatch):
    path = str(build_tiny_checkpoint(tmp_path / "qwen3moe", "Qwen3MoeForCausalLM"))
    prompts = mixed_prompts(5, lengths=(1, 9, 23))
    engine = dict(block_size=4, num_kv_blocks=64, max_model_len=64)
    monkeypatch.setenv(MOE_KERNEL_ENV, "torch")
    expected = run(LLM(path, **engine), prompts, max_tokens=6)
    monkeypatch.setenv(MOE_KERNEL_ENV, "triton")
    llm = LLM(path, **engine)
    methods = {type(m.moe_method) for m in llm.engine.executor.runner.model.modules()
               if isinstance(m, FusedMoE)}
    assert methods == {TritonMoEMethod}
    assert run(llm, prompts, max_tokens=6) == expected


@on_cpu
def test_benchmark_smoke_run_on_cpu(tmp_path, monkeypatch, capsys):
    """``benchmarks/moe_kernels.py --device cpu`` runs its tiny shapes through the
    interpreter, agrees with the per-expert loop and appends its table under its section."""
    bench = load_benchmark(monkeypatch, "moe_kernels.py")
    results = tmp_path / "RESULTS.md"
    bench.main(["--device", "cpu", "--results", str(results)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][1:]
    assert len(rows) == len(bench.CPU_WORKLOAD.tokens)
    assert all(float(row.split("|")[-2]) < 1e-5 for row in rows)  # rel. diff column
    assert bench.SECTION in results.read_text()


# DeepSeek-V2-Lite's expert layers: 64 experts, top-6, hidden 2048, intermediate 1408.
V2_LITE = dict(experts=64, top_k=6, hidden=2048, inter=1408)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 64, 1000])
def test_fused_moe_bf16_at_deepseek_v2_lite_shapes(tokens):
    x, w13, w2, weights, ids = random_moe(
        tokens, V2_LITE["top_k"], V2_LITE["experts"], V2_LITE["hidden"], V2_LITE["inter"],
        torch.bfloat16, device="cuda")
    want = reference_moe_dense(x, w13, w2, weights, ids)
    got = fused_moe(x, w13, w2, weights, ids)
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2


def reference_moe_dense(hidden, w13, w2, topk_weights, topk_ids):
    """Float64 on the GPU, one expert at a time over its tokens (the per-token loop is too
    slow at these shapes)."""
    hidden, w13, w2 = hidden.double(), w13.double(), w2.double()
    inter = w2.shape[2]
    out = torch.zeros_like(hidden)
    for e in range(w13.shape[0]):
        tok, j = (topk_ids == e).nonzero(as_tuple=True)
        if tok.numel():
            gate_up = hidden[tok] @ w13[e].T
            act = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            out.index_add_(0, tok, (act @ w2[e].T) * topk_weights[tok, j, None].double())
    return out


@pytest.mark.gpu
def test_fused_moe_replays_in_a_cuda_graph_with_new_routing():
    x, w13, w2, weights, ids = random_moe(16, 6, 64, 2048, 1408, torch.bfloat16,
                                          device="cuda")
    fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, w13, w2, weights, ids)
    new_x, _, _, new_weights, new_ids = random_moe(16, 6, 64, 2048, 1408, torch.bfloat16,
                                                   device="cuda", used=7, seed=1)
    x.copy_(new_x)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    assert torch.equal(out, fused_moe(x, w13, w2, weights, ids))


@pytest.mark.gpu
def test_qwen3_moe_on_cuda_greedy_tokens_equal_the_torch_method(tmp_path, monkeypatch):
    path = str(build_tiny_checkpoint(tmp_path / "qwen3moe", "Qwen3MoeForCausalLM"))
    prompts = mixed_prompts(5, lengths=(1, 9, 23, 40))
    engine = dict(device="cuda", dtype="float32", block_size=16)
    monkeypatch.setenv(MOE_KERNEL_ENV, "torch")
    expected = run(LLM(path, **engine), prompts)
    monkeypatch.setenv(MOE_KERNEL_ENV, "triton")
    llm = LLM(path, **engine)
    assert {type(m.moe_method) for m in llm.engine.executor.runner.model.modules()
            if isinstance(m, FusedMoE)} == {TritonMoEMethod}
    assert run(llm, prompts) == expected
