"""attention_cpu's fused elementwise kernels (fused_ops.c) and the seam that supplies them to
``hitchllm.models.fused``: every kernel against a float64 reference on random inputs of odd
sizes (one row, a few, enough for the threaded path), against PyTorch's eager functions (rotary,
the float32 norms, q/k norm and SiLU bit for bit; bfloat16 SiLU at most one bfloat16 unit
apart, and rarely), the seam's dispatch and fallbacks, and engines with the kernels against
the same engine without."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hitchllm import LLM, SamplingParams
from hitchllm.models import fused
from hitchllm.models.rope import RotaryEmbedding
from hitchllm_attention_cpu import fused as cpu_fused
from hitchllm_attention_cpu.compiler import load_fused_ops

DTYPES = {torch.float32: 0, torch.bfloat16: 1}
# rows x width: one row, a few (odd widths), and enough work for the OpenMP path.
SHAPES = [(1, 64), (5, 37), (3, 192), (300, 200)]
EPS = 1e-6


@pytest.fixture
def kernels_installed():
    """The CPU kernels registered (as a CPU engine's model load does), forgotten afterwards."""
    cpu_fused.install()
    yield
    fused.unregister_device_kernels("cpu")


def eager(fn, *args):
    """``fn`` as written in PyTorch (fusion off: no device kernel)."""
    fused.set_fusion(False)
    try:
        return fn(*args)
    finally:
        fused.set_fusion(True)


def c_rms_norm(x, weight, residual=None, threads=2):
    """The C function called directly (any dtype it has, float32 included)."""
    out, total = torch.empty_like(x), torch.empty_like(x)
    load_fused_ops().functions["hitch_rms_norm"](
        x.data_ptr(), x.stride(0), None if residual is None else residual.data_ptr(),
        0 if residual is None else residual.stride(0), total.data_ptr(), weight.data_ptr(),
        out.data_ptr(), x.shape[0], x.shape[1], EPS, DTYPES[x.dtype], threads)
    return out, total


def c_silu_and_mul(x, threads=2):
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype)
    load_fused_ops().functions["hitch_silu_and_mul"](
        x.data_ptr(), x.stride(0), out.data_ptr(), x.shape[0], x.shape[1] // 2,
        DTYPES[x.dtype], threads, threads)
    return out


def ref_rms_norm(x64, w64):
    return w64 * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + EPS)


def ref_rotary(x64, cos64, sin64):
    x1, x2 = x64.chunk(2, dim=-1)
    c, s = cos64[:, None], sin64[:, None]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def tolerance(dtype, scale=1.0):
    """float32: rounding; bfloat16: each stored intermediate is rounded (2^-8 relative), and a
    sum of two rounded products of size ``scale`` can cancel to far less than its error."""
    if dtype == torch.float32:
        return dict(rtol=1e-5, atol=1e-5 * scale)
    return dict(rtol=2e-2, atol=2e-2 * scale)


def assert_near_eager(got, want, max_fraction=1e-3):
    """bfloat16 kernels that sum or exponentiate in another order: equal but for a rare
    element one bfloat16 unit away (a float32 value on a rounding boundary)."""
    diff = got != want
    assert diff.float().mean().item() <= max_fraction
    if diff.any():
        ulp = want[diff].float().abs() * 2.0**-7
        assert bool(((got[diff].float() - want[diff].float()).abs() <= ulp).all())


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows,width", SHAPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_float64(dtype, rows, width, with_residual):
    torch.manual_seed(rows * width)
    x = (torch.randn(rows, 2 * width) * 3)[:, :width].to(dtype)  # strided rows
    residual = torch.randn(rows, width).to(dtype) if with_residual else None
    weight = torch.randn(width).to(dtype)
    out, total = c_rms_norm(x, weight, residual)
    if with_residual:
        want_total = (x.double() + residual.double()).to(dtype)
        assert torch.equal(total, want_total)  # one rounded sum, as PyTorch's add
        x = want_total
    torch.testing.assert_close(out.double(), ref_rms_norm(x.double(), weight.double()),
                               **tolerance(dtype))
    if dtype == torch.float32:  # PyTorch's float32 result: within float32 rounding
        want = eager(fused.rms_norm, x, weight, EPS)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("rows,width", SHAPES)
def test_silu_and_mul_matches_float64(kernels_installed, dtype, rows, width):
    if dtype == torch.float32 and not cpu_fused.float32_exact():
        pytest.skip("float32 SiLU needs PyTorch's exponential (libtorch exports none here)")
    torch.manual_seed(rows + width)
    x = (torch.randn(rows, 2 * width + 3) * 4)[:, : 2 * width].to(dtype)
    x[0, 0], x[0, width] = -100.0, 1.0  # exp's clamped range: silu(-100) is -0.0 here
    got = c_silu_and_mul(x)
    gate, up = x.double().chunk(2, dim=-1)
    torch.testing.assert_close(got.double(), F.silu(gate) * up, **tolerance(dtype))


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("head_dim", [32, 64, 6])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rotary_is_bitwise_eager_and_near_float64(kernels_installed, dtype, head_dim, rows):
    torch.manual_seed(head_dim * rows)
    rope = RotaryEmbedding(head_dim, max_position=512, theta=10000.0, scaling=None)
    # q and k as the attention layer slices them out of the fused qkv projection.
    qkv = (torch.randn(rows, (8 + 2 + 2) * head_dim) * 3).to(dtype)
    q, k, _ = qkv.split([8 * head_dim, 2 * head_dim, 2 * head_dim], dim=-1)
    q, k = q.reshape(rows, 8, head_dim), k.reshape(rows, 2, head_dim)
    positions = torch.randint(0, 512, (rows,))
    got = cpu_fused.rotary(positions, q, k, rope.cos, rope.sin)
    assert got is not None
    want = eager(fused.rotary, positions, q, k, rope.cos, rope.sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(fused.rotary(positions, q, k, rope.cos, rope.sin)[0], want[0])
    cos64, sin64 = rope.cos[positions].double(), rope.sin[positions].double()
    if dtype == torch.bfloat16:  # the tables are rounded to the model dtype first
        cos64, sin64 = cos64.to(dtype).double(), sin64.to(dtype).double()
    for out, x in zip(got, (q, k)):
        torch.testing.assert_close(out.double(), ref_rotary(x.double(), cos64, sin64),
                                   **tolerance(dtype, scale=x.abs().max().item()))


@pytest.mark.parametrize("rows", [1, 9, 300])
def test_qk_norm_rotary_bf16(kernels_installed, rows):
    torch.manual_seed(rows)
    d = 64
    rope = RotaryEmbedding(d, max_position=256, theta=1e6, scaling=None)
    qkv = (torch.randn(rows, (4 + 2 + 2) * d) * 2).bfloat16()
    q, k, _ = qkv.split([4 * d, 2 * d, 2 * d], dim=-1)
    q, k = q.reshape(rows, 4, d), k.reshape(rows, 2, d)
    qw, kw = torch.randn(d).bfloat16(), torch.randn(d).bfloat16()
    positions = torch.randint(0, 256, (rows,))
    got = fused.qk_norm_rotary(positions, q, k, qw, kw, EPS, rope.cos, rope.sin)
    want = eager(fused.qk_norm_rotary, positions, q, k, qw, kw, EPS, rope.cos, rope.sin)
    for g, w in zip(got, want):
        assert_near_eager(g, w)
    c = rope.cos[positions].bfloat16().double()
    s = rope.sin[positions].bfloat16().double()
    for g, x, w in zip(got, (q, k), (qw, kw)):
        normed = ref_rms_norm(x.double(), w.double())
        torch.testing.assert_close(g.double(), ref_rotary(normed, c, s), rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("rows,width", [(1, 192), (32, 192), (700, 512)])
def test_bf16_norms_and_silu_track_eager(kernels_installed, rows, width):
    torch.manual_seed(width)
    x, r = (torch.randn(rows, width) * 2).bfloat16(), torch.randn(rows, width).bfloat16()
    w, g = torch.randn(width).bfloat16(), (torch.randn(rows, 2 * width) * 3).bfloat16()
    # The norms sum in ATen's order (bit for bit, tests/test_cpug_norm.py); SiLU's
    # exponential is not PyTorch's.
    assert torch.equal(fused.rms_norm(x, w, EPS), eager(fused.rms_norm, x, w, EPS))
    got, want = fused.add_rms_norm(x, r, w, EPS), eager(fused.add_rms_norm, x, r, w, EPS)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0], want[0])
    assert_near_eager(fused.silu_and_mul(g), eager(fused.silu_and_mul, g))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rows,width", [(1, 512), (32, 768), (5, 37), (257, 333), (64, 1000)])
def test_float32_silu_is_pytorchs_bit_for_bit(kernels_installed, threads, rows, width):
    """Sleef's exponential on ATen's chunks, glibc's expf on the rest of each run; rows cut
    where ATen shares the elements among threads (over 32,768 of them: 257 x 333 and 64 x
    1000 are cut inside rows at two and three threads)."""
    if not cpu_fused.float32_exact():
        pytest.skip("libtorch exports no exponential of the kernel's width here")
    torch.manual_seed(rows * width)
    x = (torch.randn(rows, 2 * width + 5) * 6)[:, : 2 * width]  # strided rows
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = cpu_fused.silu_and_mul(x)  # the C kernel itself: None would be a refusal
        want = eager(fused.silu_and_mul, x)
    finally:
        torch.set_num_threads(saved)
    assert got is not None
    assert torch.equal(got, want), int((got != want).sum())


@pytest.mark.parametrize("rows,d", [(1, 32), (9, 64), (300, 128)])
def test_float32_qk_norm_rotary_is_pytorchs_bit_for_bit(kernels_installed, rows, d):
    if not cpu_fused.float32_exact():
        pytest.skip("PyTorch's float32 summation order not found here")
    torch.manual_seed(rows + d)
    rope = RotaryEmbedding(d, max_position=256, theta=1e6, scaling=None)
    q, k, _ = (torch.randn(rows, 8 * d) * 2).split([4 * d, 2 * d, 2 * d], dim=-1)
    q, k = q.reshape(rows, 4, d), k.reshape(rows, 2, d)
    qw, kw = torch.randn(d), torch.randn(d)
    positions = torch.randint(0, 256, (rows,))
    got = cpu_fused.qk_norm_rotary(positions, q, k, qw, kw, EPS, rope.cos, rope.sin)
    assert got is not None
    want = eager(fused.qk_norm_rotary, positions, q, k, qw, kw, EPS, rope.cos, rope.sin)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_float32_kernels_pass_without_pytorchs_numerics(kernels_installed, monkeypatch):
    """With neither the summation order nor the exponential found, float32 stays PyTorch's."""
    monkeypatch.setattr(cpu_fused, "silu_chunk", lambda: None)
    monkeypatch.setattr(cpu_fused, "sum_lanes", lambda: None)
    cpu_fused.install()
    x, w = torch.randn(4, 64), torch.randn(64)
    assert not cpu_fused.float32_exact()
    assert cpu_fused.silu_and_mul(torch.randn(4, 64)) is None
    assert cpu_fused.rms_norm(x, w, EPS) is None
    monkeypatch.undo()
    cpu_fused.install()
    half = torch.randn(4, 64).half()  # no kernel for float16
    assert cpu_fused.rms_norm(half, w.half(), EPS) is None


def test_a_second_engine_does_not_probe_again(kernels_installed, monkeypatch):
    """The probes run once per process: trying their candidates again would change the
    settings the kernels of engines already running read (and torch's thread count)."""
    functions = load_fused_ops().functions
    calls = []
    for name in ("hitch_set_sum_lanes", "hitch_set_silu_exp"):
        setter = functions[name]
        monkeypatch.setitem(functions, name,
                            lambda *args, name=name, setter=setter: calls.append(name)
                            or setter(*args))
    cpu_fused.install()
    assert calls == []


def test_rotary_position_outside_the_tables_is_an_index_error(kernels_installed):
    rope = RotaryEmbedding(32, max_position=16, theta=10000.0, scaling=None)
    q, k = torch.randn(2, 4, 32), torch.randn(2, 2, 32)
    with pytest.raises(IndexError, match="position 16 is outside the rotary tables"):
        fused.rotary(torch.tensor([3, 16]), q, k, rope.cos, rope.sin)


def test_seam_dispatches_by_device_type_and_falls_back_on_none():
    calls = []

    def kernel(x, weight, eps):
        calls.append(x.dtype)
        return None if x.dtype == torch.float32 else torch.full_like(x, 7)

    x, w = torch.randn(2, 8), torch.randn(8)
    fused.register_device_kernels("cpu", {"rms_norm": kernel})
    try:
        assert torch.equal(fused.rms_norm(x, w, EPS), eager(fused.rms_norm, x, w, EPS))
        assert torch.equal(fused.rms_norm(x.double(), w.double(), EPS),
                           torch.full((2, 8), 7, dtype=torch.float64))
        assert calls == [torch.float32, torch.float64]
        fused.set_fusion(False)  # fusion off: no kernel at all
        fused.rms_norm(x.double(), w.double(), EPS)
        assert len(calls) == 2
    finally:
        fused.set_fusion(True)
        fused.unregister_device_kernels("cpu")
    fused.rms_norm(x.double(), w.double(), EPS)
    assert len(calls) == 2


def test_seam_rejects_unknown_functions_and_cuda():
    with pytest.raises(ValueError, match="no fused function named rmsnorm"):
        fused.register_device_kernels("cpu", {"rmsnorm": lambda *a: None})
    with pytest.raises(ValueError, match="own Triton kernels on CUDA"):
        fused.register_device_kernels("cuda", {"rms_norm": lambda *a: None})


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_with_kernels_tracks_engine_without(llama_path, dtype):
    """The plugin installs the kernels when a CPU model loads; float32 greedy tokens are
    identical with and without them (only the bit-exact rotary runs), bfloat16 ones agree but
    for near ties."""
    prompts = [[5, 9, 13, 2, 7] * k for k in (1, 3, 11)] + [[3] * 40]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    tokens = {}
    for fusion in (True, False):
        fused.unregister_device_kernels("cpu")
        llm = LLM(llama_path, dtype=dtype, enable_fusion=fusion, attention_backend="CPU_ATTN")
        assert bool(fused._device_kernels) == fusion
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[fusion] = [o.outputs[0].token_ids for o in outs]
    fused.unregister_device_kernels("cpu")
    fused.set_fusion(True)
    if dtype == "float32":
        assert tokens[True] == tokens[False]
    else:
        same = sum(a == b for x, y in zip(tokens[True], tokens[False]) for a, b in zip(x, y))
        assert same >= 0.9 * sum(len(x) for x in tokens[False])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kv_cache_write_equals_torch_backend(dtype):
    """CPU_ATTN's C cache write puts every row where TORCH's puts it (strided value rows as
    sliced from qkv, padding slots skipped), and refuses a slot outside the cache."""
    from hitchllm.attention import AttentionSpec, TorchAttentionBackend
    from hitchllm_attention_cpu import CpuAttentionBackend

    heads, kv_heads, d, block, blocks = 6, 2, 32, 16, 9
    spec = AttentionSpec.for_device(torch.device("cpu"), dtype=dtype, kv_cache_dtype=dtype,
                                    head_size=d, num_heads=heads, num_kv_heads=kv_heads,
                                    block_size=block)
    shape = CpuAttentionBackend.get_kv_cache_shape(blocks, block, kv_heads, d)  # and a sink
    ours, torchs = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    tokens = 37
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d).to(dtype)
    _, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    k, v = k.contiguous().view(-1, kv_heads, d), v.view(-1, kv_heads, d)
    slots = torch.randperm(blocks * block)[:tokens]
    slots[[3, 20]] = -1  # padding
    args = (heads, d, d**-0.5, kv_heads, spec)
    CpuAttentionBackend.get_impl_cls()(*args).write_kv_cache(ours, k, v, slots)
    TorchAttentionBackend.get_impl_cls()(*args).write_kv_cache(torchs, k, v, slots)
    real = slice(0, blocks)  # TORCH sends padding to the sink block after them
    assert torch.equal(ours[:, :, real], torchs[:, :, real])
    assert ours[:, :, real].count_nonzero() == 2 * (tokens - 2) * kv_heads * d
    with pytest.raises(IndexError, match="outside the KV cache"):
        CpuAttentionBackend.get_impl_cls()(*args).write_kv_cache(
            ours, k, v, torch.full((tokens,), shape[2] * block))
