"""Split-K projections summed by the norm after them (``hitchllm.models.split_k``): the partial
sums against float64, the add-and-norm kernel against ``fused``'s PyTorch arithmetic (Triton's
interpreter on the CPU, PTX on a GPU), the decoder's plumbing through a whole model, and the
route's conditions."""

from __future__ import annotations

import pytest
import torch

from hitchllm import LLM, SamplingParams
from hitchllm.layers.linear import RowParallelLinear
from hitchllm.layers.method import UnquantizedLinearMethod
from hitchllm.models import fused, split_k, split_k_kernels
from hitchllm.tiny_model import build_tiny_checkpoint

GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


def _op_by_op(split, residual, weight, eps=1e-6):
    total = split.total() + residual
    return fused._normalize(total, weight, eps), total


@pytest.mark.parametrize("rows", [1, 5, 16, 17, 64, 100, 128])
def test_partial_sums_add_up_to_the_product(rows):
    """Every tile configuration (1-16, 17-64, 65-128 rows), rows that do not fill a tile,
    against float64."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 512, generator=g)
    w = torch.randn(128, 512, generator=g) * 0.05
    parts = split_k_kernels.partial_sums(x, w)
    assert parts is not None and parts.shape[1:] == (rows, 128)
    assert parts.shape[0] == split_k_kernels.tiles(rows).splits
    split = split_k.SplitSum(parts, torch.float32)
    want = x.double() @ w.double().T
    torch.testing.assert_close(split.parts.double().sum(0), want, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(split.total().double(), want, atol=1e-4, rtol=1e-5)


def test_partial_sums_decline_what_the_tiles_do_not_cover():
    x = torch.randn(8, 512)
    w = torch.randn(128, 512)
    partial_sums = split_k_kernels.partial_sums
    assert partial_sums(x, w) is not None
    assert partial_sums(x[:0], w) is None
    assert partial_sums(x, torch.randn(100, 512)) is None  # columns not a tile multiple
    assert partial_sums(torch.randn(8, 192), torch.randn(128, 192)) is None  # inner size
    assert partial_sums(torch.randn(8, 512), torch.randn(2048, 512)) is None  # columns cap
    assert partial_sums(torch.randn(8, 8192), torch.randn(128, 8192)) is None  # inner cap
    assert partial_sums(x.T.contiguous().T, w) is None  # strided columns
    assert partial_sums(x, w.T.contiguous().T) is None  # strided weight
    assert partial_sums(x.double(), w) is None  # dtypes differ
    assert partial_sums(x.half(), w.half()) is None  # float16: no roundings for it


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_norm_kernel_matches_pytorch(device, dtype):
    """The parts summed in split order and rounded as the projection's output, the residual
    added and normalized as ``fused.add_rms_norm`` (bf16 rounded where PyTorch rounds)."""
    rows = 7 if device == "cpu" else 64
    g = torch.Generator().manual_seed(0)
    parts = torch.randn(3, rows, 1000, generator=g).to(device)
    residual = (torch.randn(rows, 1000, generator=g) * 4).to(dtype).to(device)
    weight = (torch.rand(1000, generator=g) + 0.5).to(dtype).to(device)
    split = split_k.SplitSum(parts, dtype)
    got = split_k.add_rms_norm(split, residual, weight, 1e-6)
    want = _op_by_op(split, residual, weight)
    for a, b in zip(got, want):
        assert a.dtype == dtype and a.shape == b.shape
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        else:  # sums of squares in another order may round a normalized value the other way
            assert (a != b).float().mean() < 2e-3
            torch.testing.assert_close(a, b, atol=0.04, rtol=0.01)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the residual stream, exactly


def test_add_norm_takes_a_strided_residual_and_falls_back_for_other_dtypes():
    """A residual with a row stride (a view); weights of another dtype, and float16, go to
    ``fused.add_rms_norm`` of the summed parts."""
    g = torch.Generator().manual_seed(1)
    parts = torch.randn(2, 4, 64, generator=g)
    wide = torch.randn(4, 128, generator=g)
    weight = torch.rand(64, generator=g) + 0.5
    split = split_k.SplitSum(parts, torch.float32)
    got = split_k.add_rms_norm(split, wide[:, :64], weight, 1e-6)
    for a, b in zip(got, _op_by_op(split, wide[:, :64], weight)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    got = split_k.add_rms_norm(split, wide[:, :64], weight.double(), 1e-6)
    for a, b in zip(got, fused.add_rms_norm(split.total(), wide[:, :64], weight.double(), 1e-6)):
        torch.testing.assert_close(a, b)
    half = split_k.SplitSum(parts, torch.float16)  # the kernel rounds bf16 only: PyTorch's path
    got = split_k.add_rms_norm(half, wide[:, :64].half(), weight.half(), 1e-6)
    for a, b in zip(got, _op_by_op(half, wide[:, :64].half(), weight.half())):
        assert a.dtype == torch.float16
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_project_runs_the_layer_off_cuda():
    """On the CPU (and for anything else the route does not take) ``project`` is the layer."""
    proj = RowParallelLinear(512, 128)
    torch.nn.init.normal_(proj.weight)
    x = torch.randn(4, 512)
    out = split_k.project(proj, x)
    assert isinstance(out, torch.Tensor)
    torch.testing.assert_close(out, proj(x), atol=0, rtol=0)


def test_a_model_with_split_sums_generates_as_without(tmp_path, monkeypatch):
    """The decoder's plumbing: ``o_proj`` and ``down_proj`` forced onto split sums on the CPU
    (float32, the interpreter) give the logprobs of the plain model, prompt and decode steps,
    through every layer and the final norm."""
    path = build_tiny_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", hidden_size=256,
                                 num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                 intermediate_size=512, num_hidden_layers=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 17, 300, 42, 8]}, {"prompt_token_ids": [99, 3]}]

    def run():
        llm = LLM(str(path), dtype="float32", enforce_eager=True)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(prompts, params)]

    plain = run()
    calls = []

    def forced(proj, x):
        parts = split_k_kernels.partial_sums(x, proj.weight)
        calls.append(parts is not None)
        return split_k.SplitSum(parts, x.dtype) if parts is not None else proj(x)

    monkeypatch.setattr(split_k, "project", forced)
    split = run()
    assert calls and all(calls)
    for (tokens_a, lp_a), (tokens_b, lp_b) in zip(plain, split):
        assert tokens_a == tokens_b
        for step_a, step_b in zip(lp_a, lp_b):
            assert step_a.keys() == step_b.keys()
            for t in step_a:
                assert abs(step_a[t].logprob - step_b[t].logprob) < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("rows", [1, 16, 17, 64, 100, 128])
@pytest.mark.parametrize("inner", [2048, 3072])
def test_gpu_bf16_no_further_from_float64_than_cublas(rows, inner):
    """Qwen3-0.6B's o_proj and down_proj shapes in bf16: the split sums' output (rounded to
    bf16) no further from float64 than cuBLAS's, and the route taken."""
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, inner, device="cuda", generator=g).bfloat16()
    proj = RowParallelLinear(inner, 1024, quant_config=None).cuda().bfloat16()
    proj.weight.data.normal_(0, 0.02, generator=g)
    with torch.inference_mode():
        split = split_k.project(proj, x)
        assert isinstance(split, split_k.SplitSum)
        exact = x.double() @ proj.weight.double().T
        ours = (split.total().double() - exact).abs().max()
        cublas = (proj(x).double() - exact).abs().max()
    assert ours <= 1.25 * cublas, (ours, cublas)


class _Wrapped(UnquantizedLinearMethod):
    """A linear method of another type around the same weight (as LoRA's wraps one)."""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_project_declines_what_the_route_does_not_take():
    """Bias, fusion off, autograd, another linear method, float16, more than ``MAX_ROWS`` rows
    and a projection larger than the measured shapes all run the layer itself."""
    def layer(bias=False, columns=1024):
        proj = RowParallelLinear(2048, columns, bias=bias).cuda().bfloat16()
        proj.weight.data.normal_(0, 0.02)
        return proj

    x = torch.randn(16, 2048, device="cuda").bfloat16()
    with torch.inference_mode():
        assert isinstance(split_k.project(layer(), x), split_k.SplitSum)
        assert isinstance(split_k.project(layer(bias=True), x), torch.Tensor)
        assert isinstance(split_k.project(layer(columns=2048), x), torch.Tensor)
        rows = torch.randn(split_k.MAX_ROWS + 1, 2048, device="cuda").bfloat16()
        assert isinstance(split_k.project(layer(), rows), torch.Tensor)
        assert isinstance(split_k.project(layer().half(), x.half()), torch.Tensor)
        wrapped = layer()
        wrapped.linear_method = _Wrapped()
        assert isinstance(split_k.project(wrapped, x), torch.Tensor)
        fused.set_fusion(False)
        try:
            assert isinstance(split_k.project(layer(), x), torch.Tensor)
        finally:
            fused.set_fusion(True)
    with torch.enable_grad():
        assert isinstance(split_k.project(layer(), x.clone().requires_grad_()), torch.Tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_graphs_equal_eager_runs_on_the_split_route(tmp_path, monkeypatch):
    """A bf16 model whose projections take the route (hidden 256, 8 x 32 heads, MLP 512):
    decode graphs and graph pieces give the tokens of the same padded steps run eagerly,
    greedy and seeded (the logits must match exactly), and the route is taken."""
    path = str(build_tiny_checkpoint(tmp_path / "m", "Qwen3ForCausalLM", hidden_size=256,
                                     num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                                     intermediate_size=512, num_hidden_layers=2))
    taken = []
    partial_sums = split_k_kernels.partial_sums
    monkeypatch.setattr(split_k_kernels, "partial_sums",
                        lambda x, w: taken.append(x.shape[0]) or partial_sums(x, w))
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 500, (n,), generator=g).tolist() for n in (3, 57, 20, 9, 31)]
    kwargs = dict(device="cuda", dtype="bfloat16", attention_backend="TRITON_ATTN",
                  max_num_batched_tokens=64)
    eager = LLM(path, enforce_eager=True, **kwargs)
    graphs = LLM(path, **kwargs)
    assert graphs.engine.executor.runner.graphs.captured

    def run(llm: LLM, temperature: float) -> list[list[int]]:
        params = [SamplingParams(temperature=temperature, seed=i if temperature else None,
                                 max_tokens=6 + 4 * i, ignore_eos=True)
                  for i in range(len(prompts))]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    for temperature in (0.0, 1.0):
        assert run(graphs, temperature) == run(eager, temperature)
    assert taken
