"""The norms' and the activation's Triton kernels (``hitchllm.models.elementwise_kernels``)
against ``fused``'s PyTorch arithmetic run op by op (Triton's interpreter on the CPU, PTX on a
GPU), what they decline, and the route ``fused`` takes to them on CUDA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hitchllm.models import elementwise_kernels as ek
from hitchllm.models import fused

GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device")])


def _silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _assert_matches(got, want, dtype, exact_share):
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert (got != want).float().mean() <= exact_share
        torch.testing.assert_close(got, want, atol=0.04, rtol=0.01)


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [1000, 1024, 7168, 16384])
def test_norms_match_pytorch(device, dtype, columns):
    """RMSNorm and add + RMSNorm (row strides on the input and the residual, as views give;
    widths of 4, 8 and 16 warps): the residual stream bit for bit, the normalized values
    rounded where PyTorch rounds (a sum of squares in another order may round one the other
    way)."""
    rows = 6 if device == "cpu" else 300
    g = torch.Generator().manual_seed(columns)
    wide = (torch.randn(rows, columns + 64, generator=g) * 3).to(dtype).to(device)
    x = wide[:, :columns]
    residual = (torch.randn(rows, columns + 32, generator=g) * 4).to(dtype).to(device)
    residual = residual[:, 32:]
    assert x.stride(0) == columns + 64 and residual.stride(0) == columns + 32
    weight = (torch.rand(columns, generator=g) + 0.5).to(dtype).to(device)
    _assert_matches(ek.rms_norm(x, weight, 1e-6), fused._normalize(x, weight, 1e-6), dtype,
                    2e-3)
    out, total = ek.add_rms_norm(x, residual, weight, 1e-6)
    want_total = x + residual
    torch.testing.assert_close(total, want_total, atol=0, rtol=0)
    _assert_matches(out, fused._normalize(want_total, weight, 1e-6), dtype, 2e-3)


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("columns", [300, 3072])
def test_silu_and_mul_matches_pytorch(device, dtype, columns):
    """``silu(gate) * up`` with PyTorch's roundings (silu rounded before the product); columns
    that do not fill the last program; large gates whose exponentials overflow; a row stride,
    as a view gives."""
    rows = 5 if device == "cpu" else 300
    g = torch.Generator().manual_seed(columns)
    gate_up = (torch.randn(rows, 2 * columns + 16, generator=g) * 4)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -1e4, 0.0])
    gate_up = gate_up.to(dtype).to(device)[:, :2 * columns]
    assert gate_up.stride(0) == 2 * columns + 16
    # The interpreter's exponential is numpy's, a unit in the last place from PyTorch's CPU
    # one in some values; on a GPU both are CUDA's expf.
    _assert_matches(ek.silu_and_mul(gate_up), _silu_and_mul(gate_up), dtype,
                    1e-3 if device == "cpu" else 0.0)


def test_kernels_decline_what_they_do_not_take():
    x = torch.randn(4, 64)
    w = torch.rand(64) + 0.5
    assert ek.rms_norm(x.half(), w.half(), 1e-6) is None  # float16: no roundings for it
    assert ek.rms_norm(x, w.double(), 1e-6) is None  # dtypes differ
    # [tokens, heads, d], as q of a fused qkv projection, at any token count
    for tokens in (4, 1):
        q = torch.randn(tokens, 3 * 64)[:, :128].view(tokens, 2, 64)
        assert ek.rms_norm(q, w, 1e-6) is None
        assert ek.add_rms_norm(q, q, w, 1e-6) is None
        assert ek.silu_and_mul(q) is None
    assert ek.rms_norm(x.T.contiguous().T, w, 1e-6) is None  # strided columns
    assert ek.rms_norm(torch.randn(2, 20000), torch.rand(20000), 1e-6) is None  # too wide
    assert ek.add_rms_norm(x, torch.randn(4, 32), w, 1e-6) is None  # shapes differ
    assert ek.add_rms_norm(x, x.bfloat16(), w, 1e-6) is None
    assert ek.silu_and_mul(torch.randn(4, 63)) is None  # no halves
    assert ek.silu_and_mul(torch.randn(4, 64).half()) is None


def test_kernels_decline_arguments_that_need_gradients():
    """The kernels have no backward: with autograd on, an argument that requires gradients
    goes to the compiled route (which keeps the graph); under no_grad the kernels run."""
    x = torch.randn(4, 64)
    w = torch.rand(64) + 0.5
    parts = torch.randn(2, 4, 64)
    needs = [t.clone().requires_grad_() for t in (x, w, parts)]
    gx, gw, gparts = needs
    assert ek.rms_norm(gx, w, 1e-6) is None
    assert ek.rms_norm(x, gw, 1e-6) is None
    assert ek.add_rms_norm(x, gx, w, 1e-6) is None
    assert ek.add_rms_norm_of_parts(gparts, torch.float32, x, w, 1e-6) is None
    assert ek.silu_and_mul(gx) is None
    with torch.no_grad():
        assert ek.rms_norm(gx, gw, 1e-6) is not None
        assert ek.add_rms_norm(x, gx, gw, 1e-6) is not None
        assert ek.add_rms_norm_of_parts(gparts, torch.float32, gx, gw, 1e-6) is not None
        assert ek.silu_and_mul(gx) is not None
    assert ek.add_rms_norm_of_parts(parts, torch.float32, x, w, 1e-6) is not None


def test_a_single_row_vector_is_one_row():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, generator=g)
    w = torch.rand(64, generator=g) + 0.5
    torch.testing.assert_close(ek.rms_norm(x, w, 1e-6), fused._normalize(x, w, 1e-6))
    out, total = ek.add_rms_norm(x, x * 2, w, 1e-6)
    assert out.shape == total.shape == x.shape
    torch.testing.assert_close(total, x * 3)
    torch.testing.assert_close(ek.silu_and_mul(x), _silu_and_mul(x), atol=1e-6, rtol=1e-6)


def test_empty_batches_give_empty_results():
    w = torch.rand(64) + 0.5
    empty = torch.randn(0, 64)
    assert ek.rms_norm(empty, w, 1e-6).shape == (0, 64)
    out, total = ek.add_rms_norm(empty, empty, w, 1e-6)
    assert out.shape == total.shape == (0, 64)
    assert ek.silu_and_mul(empty).shape == (0, 32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_functions_run_the_kernels_on_cuda(monkeypatch):
    """On CUDA ``fused``'s norms and activation are these kernels (nothing is compiled for
    bfloat16); float16, which they decline, still runs compiled."""
    compiled = []

    def compile_(fn, **kwargs):
        compiled.append(fn.__name__)
        return fn

    monkeypatch.setattr(torch, "compile", compile_)
    # Wrapped afresh as ``fused`` wraps them: a function compiled by an earlier test in this
    # process would not call torch.compile again.
    route = fused._triton_on_cuda("elementwise_kernels")
    rms_norm, add_rms_norm, silu_and_mul = (route(f.__wrapped__) for f in (
        fused.rms_norm, fused.add_rms_norm, fused.silu_and_mul))
    x = torch.randn(5, 256, device="cuda").bfloat16()
    w = (torch.rand(256, device="cuda") + 0.5).bfloat16()
    assert torch.equal(rms_norm(x, w, 1e-6), ek.rms_norm(x, w, 1e-6))
    for a, b in zip(add_rms_norm(x, x, w, 1e-6), ek.add_rms_norm(x, x, w, 1e-6)):
        assert torch.equal(a, b)
    assert torch.equal(silu_and_mul(x), ek.silu_and_mul(x))
    assert compiled == []
    silu_and_mul(x.half())
    assert compiled == ["silu_and_mul"]
    # and ``fused``'s own functions are routed so (their results are the kernels' bits)
    assert torch.equal(fused.rms_norm(x, w, 1e-6), ek.rms_norm(x, w, 1e-6))
    assert torch.equal(fused.add_rms_norm(x, x, w, 1e-6)[0], ek.add_rms_norm(x, x, w, 1e-6)[0])
    assert torch.equal(fused.silu_and_mul(x), ek.silu_and_mul(x))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_functions_keep_gradients_on_cuda(monkeypatch):
    """With autograd on, ``fused``'s functions take the compiled route for tensors that need
    gradients (here ``torch.compile`` stands in as the identity), so the result has a graph
    and its gradients are PyTorch's."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    route = fused._triton_on_cuda("elementwise_kernels")
    rms_norm, add_rms_norm, silu_and_mul = (route(f.__wrapped__) for f in (
        fused.rms_norm, fused.add_rms_norm, fused.silu_and_mul))
    x = torch.randn(3, 64, device="cuda").requires_grad_()
    w = (torch.rand(64, device="cuda") + 0.5).requires_grad_()
    out = rms_norm(x, w, 1e-6) + add_rms_norm(x, x.detach(), w, 1e-6)[0] + silu_and_mul(x).sum()
    out.sum().backward()
    want_x, want_w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    want = (fused._normalize(want_x, want_w, 1e-6)
            + fused._normalize(want_x + want_x.detach(), want_w, 1e-6)
            + _silu_and_mul(want_x).sum())
    want.sum().backward()
    torch.testing.assert_close(x.grad, want_x.grad)
    torch.testing.assert_close(w.grad, want_w.grad)
