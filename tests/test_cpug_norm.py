"""attention_cpu's RMSNorm kernels in float32 (fused_ops.c, registered for
``hitchllm.models.fused``): bit for bit PyTorch's eager RMSNorm (sum of squares in ATen's
summation order, then mean, eps, rsqrt, the two products) on random rows of many widths (under
one vector, odd tails, several cascade levels), strided rows, one and two threads; the vector
width the plugin finds is the one that matches, the other does not; an engine whose norms run
the kernel gives the same greedy tokens and logprobs as one without."""

from __future__ import annotations

import pytest
import torch
from test_cpuf_kernels import eager
from test_cpuf_kernels import kernels_installed as kernels_installed  # a fixture

from hitchllm import LLM, SamplingParams
from hitchllm.models import fused
from hitchllm_attention_cpu import fused as cpu_fused
from hitchllm_attention_cpu.compiler import load_fused_ops

WIDTHS = [*range(1, 40), 63, 64, 65, 127, 191, 192, 256, 511, 513, 1000, 1031, 2048, 4099, 9000,
          40001]
EPS = 1e-6


@pytest.fixture(scope="module")
def lanes():
    found = cpu_fused.sum_lanes()
    if found is None:
        pytest.skip("ATen's sum order on this build is neither the AVX2 nor the AVX-512 one")
    return found


def c_norm(x, w, residual=None, threads=2):
    out, total = torch.empty(x.shape), torch.empty(x.shape)
    load_fused_ops().functions["hitch_rms_norm"](
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), total.data_ptr(), w.data_ptr(),
        out.data_ptr(), x.shape[0], x.shape[1], EPS, 0, threads)
    return out, total


@pytest.mark.parametrize("width", WIDTHS)
def test_float32_rms_norm_is_pytorch_bit_for_bit(lanes, kernels_installed, width):
    torch.manual_seed(width)
    for rows, scale, threads in [(1, 1.0, 1), (3, 1e3, 2), (40, 1e-3, 2)]:
        x, w = torch.randn(rows, width) * scale, torch.randn(width)
        want = eager(fused.rms_norm, x, w, EPS)
        if cpu_fused.rms_norm(x, w, EPS) is None:
            # One row that torch sums in parts on several threads: left to torch.
            assert rows == 1 and width >= cpu_fused.SPLIT_ROW
            continue
        assert torch.equal(c_norm(x, w, threads=threads)[0], want)


@pytest.mark.parametrize("width", [5, 192, 1031])
def test_float32_add_rms_norm_strided_rows_bit_for_bit(lanes, width):
    torch.manual_seed(width)
    x = torch.randn(33, width + 7)[:, 3:width + 3]  # rows with a stride of width + 7
    r = torch.randn(33, 2 * width)[:, :width]
    w = torch.randn(width)
    out, total = c_norm(x, w, residual=r)
    want_out, want_total = eager(fused.add_rms_norm, x, r, w, EPS)
    assert torch.equal(total, want_total)
    assert torch.equal(out, want_out)


def test_the_other_vector_width_differs(lanes):
    # The order matters: summed as a build with the other vector width would, the result is
    # not PyTorch's (so the check above can fail).
    functions = load_fused_ops().functions
    other = 16 if lanes == 8 else 8
    x, w = torch.randn(64, 192) * 10, torch.randn(192)
    try:
        functions["hitch_set_sum_lanes"](other)
        assert not torch.equal(c_norm(x, w)[0], eager(fused.rms_norm, x, w, EPS))
    finally:
        functions["hitch_set_sum_lanes"](lanes)
    assert functions["hitch_set_sum_lanes"](12) == -1


def test_float32_norms_run_the_kernel_through_the_seam(lanes, kernels_installed):
    x, r, w = torch.randn(4, 192), torch.randn(4, 192), torch.randn(192)
    assert cpu_fused.rms_norm(x, w, EPS) is not None
    assert cpu_fused.add_rms_norm(x, r, w, EPS) is not None
    assert torch.equal(fused.rms_norm(x, w, EPS), eager(fused.rms_norm, x, w, EPS))
    assert cpu_fused.rms_norm(x.double(), w.double(), EPS) is None


def test_float32_engine_with_norm_kernels_equals_without(lanes, llama_path):
    prompts = [[5, 9, 13, 2, 7, 11, 3], [4, 4, 8, 15, 16, 23, 42, 1, 2, 3, 4, 5]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outs = []
    for fusion in (True, False):
        fused.unregister_device_kernels("cpu")
        llm = LLM(llama_path, dtype="float32", device="cpu", enable_fusion=fusion,
                  attention_backend="CPU_ATTN")
        assert bool(fused._device_kernels) == fusion
        assert (torch.float32 in cpu_fused._norm_dtypes) or not fusion
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs.append([(list(o.outputs[0].token_ids),
                      [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
                     for o in res])
        del llm
    fused.unregister_device_kernels("cpu")
    fused.set_fusion(True)
    assert outs[0] == outs[1]
