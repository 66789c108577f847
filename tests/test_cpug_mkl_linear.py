"""attention_cpu's float32 linear through MKL's packed GEMM (mkl_linear.py): bit for bit
``F.linear`` at 16-32 rows on the model shapes of the peer benchmark and odd ones, one and two
threads; other calls pass; the plugin attaches it to a float32 CPU model's linear layers, and
an engine with it gives the same greedy tokens and logprobs as one without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hitchllm import LLM, SamplingParams
from hitchllm.layers import CPU_F32_KERNEL, UnquantizedLinearMethod
from hitchllm.models import fused
from hitchllm_attention_cpu import mkl_linear

pytestmark = pytest.mark.skipif(not mkl_linear.available(), reason="torch without MKL")

# [n, k]: the bundled model's and the peer Llama's projections and LM heads, odd sizes.
SHAPES = [(320, 192), (1024, 192), (192, 512), (192, 192), (4096, 192), (512, 256),
          (1536, 256), (256, 768), (256, 256), (100, 37), (64, 64), (128, 64)]


@pytest.mark.parametrize("n,k", SHAPES)
def test_packed_gemm_is_f_linear_bit_for_bit(n, k):
    assert mkl_linear.same_as_f_linear(n, k)
    torch.manual_seed(n + k)
    weight = torch.randn(n, k)
    kernel = mkl_linear.MklPackedLinear(weight)
    x = torch.randn(40, k) * 4
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in range(mkl_linear.MIN_ROWS, mkl_linear.PACKED_ROWS + 1):
                got = kernel(x[:rows])
                assert got is not None and got.shape == (rows, n)
                assert torch.equal(got, F.linear(x[:rows], weight)), (t, rows)
    finally:
        torch.set_num_threads(threads)


def test_the_check_finds_a_shape_where_small_row_paths_reach_16_rows():
    # 33 x 1000 on one thread: F.linear at 16 rows is not the packed GEMM's order, so install
    # leaves such a layer on F.linear (and the bit-for-bit test above can fail).
    assert not mkl_linear.same_as_f_linear(33, 1000)


def test_other_calls_pass():
    kernel = mkl_linear.MklPackedLinear(torch.randn(64, 32))
    assert kernel(torch.randn(mkl_linear.MIN_ROWS - 1, 32)) is None  # MKL's small-row paths
    assert kernel(torch.randn(mkl_linear.PACKED_ROWS + 1, 32)) is None
    assert kernel(torch.randn(20, 32).bfloat16()) is None
    assert kernel(torch.randn(20, 64)[:, ::2]) is None  # not contiguous
    assert kernel(torch.randn(20, 33)) is None


def test_any_default_dtype():
    """The output is float32 whatever torch's default dtype (MKL writes 32 x n floats into
    it: a buffer of the default dtype, bfloat16 say, would be half that)."""
    weight = torch.randn(1024, 192, dtype=torch.float32)
    x = torch.randn(20, 192, dtype=torch.float32)
    default = torch.get_default_dtype()
    try:
        for dtype in (torch.bfloat16, torch.float64):
            torch.set_default_dtype(dtype)
            got = mkl_linear.MklPackedLinear(weight)(x)
            assert got is not None and got.dtype == torch.float32
            assert torch.equal(got, F.linear(x, weight))
    finally:
        torch.set_default_dtype(default)


def test_a_lower_float32_matmul_precision_is_left_to_f_linear():
    """``torch.set_float32_matmul_precision("medium")`` lets oneDNN multiply float32 in
    bfloat16: the packed GEMM would not, so it passes while that holds."""
    kernel = mkl_linear.MklPackedLinear(torch.randn(1024, 192))
    x = torch.randn(32, 192)
    assert mkl_linear.exact_float32() and kernel(x) is not None
    try:
        torch.set_float32_matmul_precision("medium")
        assert not mkl_linear.exact_float32() and kernel(x) is None
    finally:
        torch.set_float32_matmul_precision("highest")
    assert mkl_linear.exact_float32() and kernel(x) is not None


@pytest.fixture(scope="module")
def engine_outputs(llama_path):
    """Greedy tokens and logprobs of 20 requests (decode steps of 16-20 rows), float32, with
    the kernel (fusion on) and without (fusion off), and the layers that had it."""
    prompts = [[(7 * i + j) % 97 + 1 for j in range(3 + i)] for i in range(20)]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    outs, attached = [], []
    smallest = mkl_linear.MIN_WEIGHT_ELEMENTS
    mkl_linear.MIN_WEIGHT_ELEMENTS = 0  # the tiny model's layers are below the size bound
    try:
        for fusion in (True, False):
            llm = LLM(llama_path, dtype="float32", device="cpu", enable_fusion=fusion)
            model = llm.engine.executor.worker.model
            attached.append(sum(CPU_F32_KERNEL in m.__dict__ for m in model.modules()))
            res = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
            outs.append([(list(o.outputs[0].token_ids),
                          [{t: lp.logprob for t, lp in d.items()}
                           for d in o.outputs[0].logprobs])
                         for o in res])
            del llm, model
    finally:
        mkl_linear.MIN_WEIGHT_ELEMENTS = smallest
        fused.unregister_device_kernels("cpu")
        fused.set_fusion(True)
    return outs, attached


def test_engine_with_packed_gemm_equals_without(engine_outputs):
    (with_kernel, without), (attached, not_attached) = engine_outputs
    assert attached > 0 and not_attached == 0
    assert with_kernel == without


def test_weight_reload_drops_the_kernel():
    layer = torch.nn.Module()
    layer.weight = torch.nn.Parameter(torch.randn(64, 32), requires_grad=False)
    layer.__dict__[CPU_F32_KERNEL] = mkl_linear.MklPackedLinear(layer.weight)
    UnquantizedLinearMethod().process_weights_after_loading(layer)
    assert CPU_F32_KERNEL not in layer.__dict__
