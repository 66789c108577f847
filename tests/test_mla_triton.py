"""TRITON_MLA's paged decode kernel against a float64 reference (CPU: Triton's interpreter,
small shapes, float32/float16; GPU: DeepSeek-V3's dims in bf16), and end to end against
transformers."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from gpu_compile import compile_check_lines
from mla_checkpoints import CONFIGS, build_tiny_deepseek
from reference import hf_greedy
from test_models_hf_parity import mixed_prompts, run

pytest.importorskip("triton")
pytest.importorskip("hitchllm_attention_mla")

from hitchllm import LLM, SamplingParams
from hitchllm.attention import AttentionSpec
from hitchllm_attention_mla.triton_mla import (
    LARGE_SMEM_TILES,
    MLADecodeTiles,
    TritonMLABackend,
    mla_decode,
)


def reference_decode(q, cache, block_table, seq_lens, scale, rank):
    """Float64 softmax(scale * q . latent) @ latent[:, :rank] per request, from the pages."""
    out = []
    for i, n in enumerate(seq_lens.tolist()):
        latent = cache[block_table[i].long()].flatten(0, 1)[:n].double()
        probs = (q[i].double() @ latent.T * scale).softmax(-1)
        out.append(probs @ latent[:, :rank])
    return torch.stack(out)


def random_case(heads, rank, rope, seq_lens, block_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    cols = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * cols + 3
    cache = torch.randn(num_blocks + 1, block_size, rank + rope, generator=gen).to(device, dtype)
    # Shuffled pages: each request's blocks are scattered over the pool.
    block_table = torch.randperm(num_blocks, generator=gen)[: len(seq_lens) * cols]
    block_table = block_table.view(len(seq_lens), cols).int().to(device)
    q = torch.randn(len(seq_lens), heads, rank + rope, generator=gen).to(device, dtype)
    return q, cache, block_table, torch.tensor(seq_lens, dtype=torch.int32, device=device)


@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [5, 20])  # one block of heads, and two (the last partial)
def test_decode_kernel_matches_float64(num_splits, dtype, heads):
    seq_lens = [1, 7, 33, 50]
    q, cache, table, lens = random_case(heads, 32, 8, seq_lens, 4, dtype, "cpu")
    out = mla_decode(q, cache, table, lens, 0.2, 32, max(seq_lens), num_splits=num_splits)
    assert out.dtype == dtype
    expected = reference_decode(q, cache, table, lens, 0.2, 32)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


# Larger head blocks and the output columns split over programs (each recomputing the scores).
@pytest.mark.parametrize("tiles", [MLADecodeTiles(block_h=32, block_n=32, block_o=16),
                                   MLADecodeTiles(block_h=16, block_n=16, block_o=32)])
@pytest.mark.parametrize("num_splits", [1, 2])
def test_decode_kernel_tiles_match_float64(tiles, num_splits):
    seq_lens = [0, 9, 40]
    q, cache, table, lens = random_case(20, 32, 8, seq_lens, 4, torch.float32, "cpu")
    out = mla_decode(q, cache, table, lens, 0.2, 32, max(seq_lens), num_splits=num_splits,
                     tiles=tiles)
    expected = reference_decode(q, cache, table, lens, 0.2, 32)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_triton_mla_refuses_cpu_without_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    spec = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=40, num_heads=4, num_kv_heads=1, block_size=4, use_mla=True)
    assert any("TRITON_INTERPRET=1" in r for r in TritonMLABackend.validate(spec))


def test_deepseek_on_triton_mla_matches_transformers(tmp_path):
    arch, overrides = CONFIGS["v3-yarn"]
    path = build_tiny_deepseek(tmp_path / "v3", arch, seed=2, **overrides)
    prompts = mixed_prompts(6, lengths=(3, 20))
    llm = LLM(path, block_size=4, attention_backend="TRITON_MLA")
    assert run(llm, prompts, max_tokens=6) == hf_greedy(path, prompts, 6)


def test_kernels_compile_for_gpus_without_one(tmp_path):
    """The decode kernel's H100 and A100 tiles, the Hopper Gluon kernel and the merge compile
    (Triton's compiler and ptxas run on any machine) within the shared memory their tiles were
    chosen for, which the interpreter does not check. A fresh process: this one's kernels are
    the interpreter's."""
    lines = compile_check_lines("hitchllm_attention_mla.compile_check", tmp_path)
    assert len(lines) == 6 and all(line.endswith(", fits") for line in lines), lines


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_kernel_deepseek_v3_dims_on_gpu(block_size):
    """128 heads, latent 512 + rope 64, bf16, contexts up to 3000 tokens split over programs."""
    seq_lens = [1, 300, 2048, 3000]
    q, cache, table, lens = random_case(128, 512, 64, seq_lens, block_size, torch.bfloat16,
                                        "cuda")
    scale = 192 ** -0.5
    out = mla_decode(q, cache, table, lens, scale, 512, max(seq_lens))
    expected = reference_decode(q, cache, table, lens, scale, 512)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "gluon_sm90"])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("num_splits", [1, 5, None])
def test_h100_decode_kernels_on_gpu(kernel, heads, num_splits):
    """Both kernels of the H100 tiles (Triton's, and the Gluon one the Hopper tiles pick) at
    DeepSeek's latent dims: a head count that fills a quarter of a 64-head block (V2-Lite's
    16), a padding row (empty context), contexts that end inside and at the edge of a tile, and
    splits past the end of short contexts; pages of 16 and 64; int32 and int64 lengths."""
    import hitchllm_attention_mla.triton_mla as tm

    if kernel == "gluon_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90 (Hopper)")
    smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    if smem < tm.LARGE_SMEM_BYTES:
        pytest.skip(f"the H100 tiles need {tm.LARGE_SMEM_BYTES} bytes of shared memory")
    tiles = dataclasses.replace(LARGE_SMEM_TILES, kernel=kernel)
    seq_lens = [0, 1, 63, 64, 65, 700, 2049]
    # int32 lengths as the engine passes them, int64 as mla_decode takes them too.
    for block_size, lengths_dtype in ((16, torch.int32), (64, torch.int64)):
        q, cache, table, lens = random_case(heads, 512, 64, seq_lens, block_size,
                                            torch.bfloat16, "cuda", seed=block_size)
        lens = lens.to(lengths_dtype)
        scale = 192 ** -0.5
        # The Gluon case must run the Gluon kernel, not its fallback.
        assert tm._gluon_takes(q, cache, lens, 512, tiles) == (kernel == "gluon_sm90")
        out = mla_decode(q, cache, table, lens, scale, 512, max(seq_lens),
                         num_splits=num_splits, tiles=tiles)
        assert (lengths_dtype, block_size) not in tm._gluon_failed
        expected = reference_decode(q, cache, table, lens, scale, 512)
        torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["triton", "gluon_sm90"])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_h100_decode_kernels_follow_a_growing_maximum(kernel, num_splits):
    """Scores that grow along the context (latents scaled from 1/4 to 4 by position, scores
    climbing some 30 powers of two), so the running maximum moves many times in the middle of
    a split and in both of the Gluon kernel's warpgroups' tiles; and shrinking scores, where
    it never moves after the first tile."""
    import hitchllm_attention_mla.triton_mla as tm

    if kernel == "gluon_sm90" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90 (Hopper)")
    if torch.cuda.get_device_properties(0).shared_memory_per_block_optin < tm.LARGE_SMEM_BYTES:
        pytest.skip(f"the H100 tiles need {tm.LARGE_SMEM_BYTES} bytes of shared memory")
    tiles = dataclasses.replace(LARGE_SMEM_TILES, kernel=kernel)
    seq_lens = [2000, 1500, 333]
    q, cache, table, lens = random_case(128, 512, 64, seq_lens, 16, torch.bfloat16, "cuda")
    for request, (n, grow) in enumerate(zip(seq_lens, (True, False, True))):
        ramp = 16.0 ** (torch.arange(n, device="cuda") / n) / 4
        ramp = ramp if grow else ramp.flip(0)
        rows = table[request].long()[torch.arange(n, device="cuda") // 16] * 16 + torch.arange(
            n, device="cuda") % 16
        flat = cache.view(-1, cache.shape[-1])
        flat[rows] = (flat[rows].float() * ramp[:, None]).to(cache.dtype)
    scale = 192 ** -0.5
    assert tm._gluon_takes(q, cache, lens, 512, tiles) == (kernel == "gluon_sm90")
    out = mla_decode(q, cache, table, lens, scale, 512, max(seq_lens), num_splits=num_splits,
                     tiles=tiles)
    expected = reference_decode(q, cache, table, lens, scale, 512)
    torch.testing.assert_close(out.double(), expected, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_deepseek_on_triton_mla_cuda_tracks_transformers(tmp_path):
    """bf16 on the GPU: rounding may flip a late near-tie; the first tokens must agree."""
    arch, overrides = CONFIGS["v2-yarn"]
    path = build_tiny_deepseek(tmp_path / "v2", arch, seed=2, **overrides)
    prompts = mixed_prompts(6, lengths=(3, 20, 45))
    llm = LLM(path, device="cuda", dtype="bfloat16", block_size=16,
              attention_backend="TRITON_MLA")
    ours = run(llm, prompts, max_tokens=4)
    ref = hf_greedy(path, prompts, 4, dtype=torch.bfloat16)
    assert [o[:2] for o in ours] == [r[:2] for r in ref]


def test_gluon_needs_triton_3_6():
    """The Hopper kernel is picked only with a Triton whose Gluon it was written for."""
    from hitchllm_attention_mla.triton_mla import gluon_supported

    assert gluon_supported("3.6.0") and gluon_supported("3.7.1") and gluon_supported("4.0.0")
    assert gluon_supported("3.6.0+git1a2b3c") and gluon_supported("3.10.0")
    assert not gluon_supported("3.5.1") and not gluon_supported("2.3.0")
    assert not gluon_supported(None)


def test_hopper_kernel_falls_back_when_it_does_not_compile(monkeypatch):
    """A Triton whose Gluon rejects the Hopper kernel: the call runs the Triton kernel instead
    (same result as with the Triton tiles), later calls of that specialization (lengths dtype,
    page size) do not try the Hopper kernel again, and another specialization still does.
    DeepSeek's latent dims (what the Hopper kernel takes), one short request, interpreter (the
    device check answers "Hopper")."""
    from types import SimpleNamespace

    from triton.compiler.errors import CompilationError

    import hitchllm_attention_mla.triton_mla as tm

    tries = []

    def broken_launch(*args, **kwargs):
        tries.append(args[3].dtype)
        raise CompilationError(None, None, "no such Gluon builtin")

    broken = SimpleNamespace(BLOCK_H=64, BLOCK_N=64, NUM_WARPS=8, ROPE=64, LAUNCH_WARPS=4,
                             mla_decode_partials_sm90={(1, 1, 1): broken_launch})
    monkeypatch.setattr(tm, "_gluon_module", lambda: broken)
    monkeypatch.setattr(tm, "_on_hopper", lambda q: True)
    monkeypatch.setattr(tm, "_gluon_failed", set())
    q, cache, table, lens = random_case(4, 512, 64, [20], 16, torch.bfloat16, "cpu")
    tiles = dataclasses.replace(tm.HOPPER_TILES, target_programs=1)
    want = mla_decode(q, cache, table, lens, 0.1, 512, 20,
                      tiles=dataclasses.replace(tiles, kernel="triton"))
    for lengths in (torch.int32, torch.int32, torch.int64):
        got = mla_decode(q, cache, table, lens.to(lengths), 0.1, 512, 20, tiles=tiles)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert tries == [torch.int32, torch.int64]
    assert tm._gluon_failed == {(torch.int32, 16), (torch.int64, 16)}


def test_hopper_kernel_needs_its_gluon(monkeypatch):
    """Where this Triton's Gluon lacks a name the kernel module uses (``_gluon_module`` is
    None), the Hopper tiles run the Triton kernel."""
    import hitchllm_attention_mla.triton_mla as tm

    monkeypatch.setattr(tm, "_gluon_module", lambda: None)
    monkeypatch.setattr(tm, "_on_hopper", lambda q: True)
    q, cache, table, lens = random_case(4, 512, 64, [20], 16, torch.bfloat16, "cpu")
    tiles = dataclasses.replace(tm.HOPPER_TILES, target_programs=1)
    assert not tm._gluon_takes(q, cache, lens, 512, tiles)
    want = mla_decode(q, cache, table, lens, 0.1, 512, 20,
                      tiles=dataclasses.replace(tiles, kernel="triton"))
    torch.testing.assert_close(mla_decode(q, cache, table, lens, 0.1, 512, 20, tiles=tiles),
                               want, rtol=0, atol=0)


def test_an_engine_run_launches_one_hopper_kernel_specialization(monkeypatch, tmp_path):
    """Every launch of the Hopper kernel in an engine run (decode batches of many sizes, so
    many split counts, and the decodes of mixed steps) falls in one of Triton's launch
    specializations, so a run never stops to build it again (seconds each on a GPU host):
    lengths are int32 in both kinds of step, and the arguments that follow the batch shape
    are not specialized. Triton specializes an integer argument on being 1 or a multiple of
    16 and a tensor on its dtype and 16-byte alignment, unless the kernel says not to. The
    launch is recorded and declined, so the Triton kernel runs in the interpreter."""
    import hitchllm_attention_mla.triton_mla as tm
    from hitchllm_attention_mla.gluon_mla_kernel import mla_decode_partials_sm90 as kernel

    specialized = [not p.do_not_specialize for p in kernel.params if not p.is_constexpr]
    keys, shapes = set(), set()

    def record(grid, args, dims, *rest):
        def kind(value, specialize: bool):
            if isinstance(value, torch.Tensor):
                return value.dtype, value.data_ptr() % 16 == 0
            if isinstance(value, int):  # its type (i32 or i64) always counts
                wide = value.bit_length() > 31
                return (wide, value == 1, value % 16 == 0) if specialize else wide
            return type(value)

        keys.add(tuple(kind(a, s) for a, s in zip(args, specialized, strict=True)))
        shapes.add(grid[1:])
        return False

    monkeypatch.setattr(tm, "_gluon_takes", lambda *args: True)
    monkeypatch.setattr(tm, "_launch_gluon", record)
    arch, overrides = CONFIGS["v2-yarn"]
    path = build_tiny_deepseek(tmp_path / "v2", arch, seed=2, **overrides)
    llm = LLM(path, block_size=16, attention_backend="TRITON_MLA", max_num_batched_tokens=48,
              max_num_seqs=8)
    prompts = mixed_prompts(5, lengths=(3, 20, 45, 70, 9, 33))
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
              for m in (24, 3, 17, 9, 30, 12)]
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    splits, sizes = {s for s, _ in shapes}, {n for _, n in shapes}
    assert len(splits) >= 3 and len(sizes) >= 4, shapes  # the run met many batch shapes
    assert len(keys) == 1, keys


def test_prompt_attention_never_asks_cudnn(monkeypatch, tmp_path):
    """The expanded prompt attention runs with cuDNN's SDPA kernel switched off: on an H100
    it built a plan for every new prompt shape (86-134 ms each, a third of a fresh
    DeepSeek-V2-Lite run). SDPA's backend switches are process-wide, so the CPU sees them."""
    import hitchllm_attention_mla.torch_mla as tm

    sdpa, calls = tm.F.scaled_dot_product_attention, []

    def checked(*args, **kwargs):
        calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(tm.F, "scaled_dot_product_attention", checked)
    arch, overrides = CONFIGS["v2-yarn"]
    path = build_tiny_deepseek(tmp_path / "v2", arch, seed=2, **overrides)
    llm = LLM(path, block_size=16, attention_backend="TRITON_MLA", max_num_batched_tokens=32)
    run(llm, mixed_prompts(4, lengths=(20, 45)), max_tokens=2)  # whole and chunked prompts
    assert calls and not any(calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()  # restored after the step
