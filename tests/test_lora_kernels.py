"""The grouped LoRA kernels (``lora_shrink`` / ``lora_expand``) against a float64 torch
reference: prefill-like runs, decode-like rows, tokens without an adapter, odd sizes, slices of
a wider output (CPU: Triton's interpreter, small shapes, float32/float16; GPU: bf16 at a
Llama-8B layer's sizes, and inside a CUDA graph)."""

from __future__ import annotations

import pytest
import torch
from bench_support import load_benchmark

pytest.importorskip("hitchllm_lora")

from hitchllm_lora.kernels import group_tokens, lora_expand, lora_shrink


def prefill_runs(tokens: int, slots: int) -> torch.Tensor:
    """Six runs of consecutive tokens (requests) of uneven lengths, the first and every
    ``slots + 1``-th one for the base model, the others for adapters 0, 1, ... in turn."""
    ends = torch.tensor([7, 10, 29, 34, 35]) * tokens // 46
    run = torch.bucketize(torch.arange(tokens), ends, right=True)
    return run % (slots + 1) - 1


SLOT_PATTERNS = {
    # One token per adapter in turn, as in a decode batch of different adapters' requests.
    "decode": lambda t, s: torch.arange(t) % s,
    "prefill": prefill_runs,
    "random-with-base": lambda t, s: torch.randint(-1, s, (t,)),
    "base-only": lambda t, s: torch.full((t,), -1),
}


def reference_shrink(x, lora_a, token_slot, scaling):
    y = torch.zeros(x.shape[0], lora_a.shape[1], dtype=torch.float64, device=x.device)
    for slot in range(lora_a.shape[0]):
        rows = token_slot == slot
        y[rows] = scaling[slot].double() * (x[rows].double() @ lora_a[slot].double().T)
    return y


def reference_expand(y, lora_b, token_slot, out, out_offset):
    want = out.double().clone()
    columns = slice(out_offset, out_offset + lora_b.shape[1])
    for slot in range(lora_b.shape[0]):
        rows = token_slot == slot
        want[rows, columns] += y[rows].double() @ lora_b[slot].double().T
    return want


def make_case(pattern, tokens, slots=3, hidden=50, rank=8, width=37, dtype=torch.float32,
              index_dtype=torch.int64, device="cpu", seed=0):
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)

    x = randn(tokens, hidden)
    lora_a = randn(slots, rank, hidden, scale=hidden**-0.5)
    lora_b = randn(slots, width, rank, scale=rank**-0.5)
    scaling = (torch.rand(slots, generator=generator) + 0.5).to(device)
    token_slot = SLOT_PATTERNS[pattern](tokens, slots).to(index_dtype).to(device)
    return x, lora_a, lora_b, scaling, token_slot


@pytest.mark.parametrize("pattern", sorted(SLOT_PATTERNS))
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_shrink_then_expand_match_float64_reference(pattern, index_dtype):
    x, lora_a, lora_b, scaling, token_slot = make_case(pattern, 40, index_dtype=index_dtype)
    y = lora_shrink(x, lora_a, token_slot, scaling)
    assert y.dtype == torch.float32 and y.shape == (40, 8)
    torch.testing.assert_close(y.double(), reference_shrink(x, lora_a, token_slot, scaling),
                               atol=1e-5, rtol=1e-5)
    out = torch.randn(40, 37 + 20)
    want = reference_expand(y, lora_b, token_slot, out, 11)
    lora_expand(y, lora_b, token_slot, out, 11)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def column_major(t: torch.Tensor) -> torch.Tensor:
    """The same values with the last two dimensions' strides swapped."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("rank", [16, 24, 64])
def test_ranks_padded_to_a_power_of_two_and_any_strides(rank):
    x, lora_a, lora_b, scaling, token_slot = make_case("random-with-base", 19, rank=rank,
                                                       hidden=33, width=45, seed=rank)
    x, lora_a, lora_b = column_major(x), column_major(lora_a), column_major(lora_b)
    y = lora_shrink(x, lora_a, token_slot, scaling)
    torch.testing.assert_close(y.double(), reference_shrink(x, lora_a, token_slot, scaling),
                               atol=1e-5, rtol=1e-5)
    out = torch.randn(19, 45)
    want = reference_expand(y, lora_b, token_slot, out, 0)
    lora_expand(y, lora_b, token_slot, out)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_float16_inputs_and_output():
    x, lora_a, lora_b, scaling, token_slot = make_case("prefill", 40, dtype=torch.float16)
    y = lora_shrink(x, lora_a, token_slot, scaling)
    torch.testing.assert_close(y.double(), reference_shrink(x, lora_a, token_slot, scaling),
                               atol=1e-3, rtol=1e-3)
    out = torch.randn(40, 37, dtype=torch.float16)
    want = reference_expand(y, lora_b, token_slot, out, 0)
    lora_expand(y, lora_b, token_slot, out)
    # One rounding to float16 of the float32 sum: within half an ulp of the exact result.
    torch.testing.assert_close(out.double(), want, atol=1e-3, rtol=2**-11)


@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_split_k_shares_of_hidden_add_up(split_k):
    x, lora_a, _, scaling, token_slot = make_case("decode", 5, slots=4, hidden=150)
    y = lora_shrink(x, lora_a, token_slot, scaling, split_k=split_k)
    torch.testing.assert_close(y.double(), reference_shrink(x, lora_a, token_slot, scaling),
                               atol=1e-5, rtol=1e-5)


def test_slices_of_a_fused_output_with_a_row_stride_leave_the_rest_alone():
    """Three slices (q, k, v) into one wider output that is itself a view with a longer row
    stride: each call adds only into its own columns and only into rows with an adapter."""
    x, _, _, scaling, token_slot = make_case("random-with-base", 23, seed=3)
    widths = (20, 9, 9)
    storage = torch.randn(23, 64)
    out = storage[:, 5:5 + sum(widths)]
    untouched = storage.clone()
    want = out.double().clone()
    offset = 0
    for i, width in enumerate(widths):
        _, lora_a, lora_b, _, _ = make_case("decode", 23, width=width, seed=10 + i)
        y = lora_shrink(x, lora_a, token_slot, scaling)
        want = reference_expand(y, lora_b, token_slot, want, offset)
        lora_expand(y, lora_b, token_slot, out, offset)
        offset += width
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    base_rows = token_slot < 0
    assert base_rows.any()
    assert torch.equal(storage[base_rows], untouched[base_rows])
    assert torch.equal(storage[:, :5], untouched[:, :5])
    assert torch.equal(storage[:, 5 + sum(widths):], untouched[:, 5 + sum(widths):])


def test_one_shrink_of_stacked_slices_feeds_each_slice_expand_through_a_column_view():
    """q, k and v's A stacked into one ``[S, 3R, H]`` pool: one shrink, then each slice's
    expand reads its columns of ``y`` (a view with a row stride of ``3R``)."""
    x, _, _, scaling, token_slot = make_case("prefill", 30, seed=4)
    parts = [make_case("prefill", 30, width=w, seed=20 + w)[1:3] for w in (16, 8, 8)]
    y = lora_shrink(x, torch.cat([a for a, _ in parts], dim=1), token_slot, scaling)
    out = torch.randn(30, 32)
    want = out.double().clone()
    offset = 0
    for i, (lora_a, lora_b) in enumerate(parts):
        y_slice = y[:, 8 * i:8 * (i + 1)]
        want = reference_expand(reference_shrink(x, lora_a, token_slot, scaling), lora_b,
                                token_slot, want, offset)
        lora_expand(y_slice, lora_b, token_slot, out, offset)
        offset += lora_b.shape[1]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_one_token_and_no_tokens():
    x, lora_a, lora_b, scaling, _ = make_case("decode", 1)
    token_slot = torch.tensor([2])
    y = lora_shrink(x, lora_a, token_slot, scaling)
    torch.testing.assert_close(y.double(), reference_shrink(x, lora_a, token_slot, scaling),
                               atol=1e-5, rtol=1e-5)
    out = torch.zeros(1, 37)
    lora_expand(y, lora_b, token_slot, out)
    torch.testing.assert_close(out.double(), reference_expand(y, lora_b, token_slot,
                                                              torch.zeros(1, 37), 0))
    empty = torch.zeros(0, dtype=torch.int32)
    y0 = lora_shrink(x[:0], lora_a, empty, scaling)
    assert y0.shape == (0, 8)
    lora_expand(y0, lora_b, empty, torch.zeros(0, 37))


def test_groups_cover_each_adapter_token_once_in_tiles_of_one_slot():
    token_slot = torch.tensor([2, 2, 0, -1, 2, 7, 1, 1, 1, 0] * 5)  # 7: outside the pool
    groups = group_tokens(token_slot, num_slots=3, block_t=16)
    assert groups.num_tiles == 4 + 3  # cdiv(50, 16) + min(3, 50), whatever the slots
    covered = []
    for slot, start, end in zip(groups.tile_slot.tolist(), groups.tile_start.tolist(),
                                groups.tile_end.tolist()):
        if slot < 0:
            continue
        assert 0 < end - start <= 16
        tokens = groups.order[start:end].long()
        assert (token_slot[tokens] == slot).all()
        covered += tokens.tolist()
    with_adapter = ((token_slot >= 0) & (token_slot < 3)).nonzero().flatten().tolist()
    assert sorted(covered) == with_adapter


def test_shared_groups_give_the_same_result_and_must_match_the_batch():
    x, lora_a, lora_b, scaling, token_slot = make_case("prefill", 40)
    groups = group_tokens(token_slot, 3, block_t=32)
    y = lora_shrink(x, lora_a, token_slot, scaling, groups=groups)
    torch.testing.assert_close(y.double(), reference_shrink(x, lora_a, token_slot, scaling),
                               atol=1e-5, rtol=1e-5)
    out = torch.zeros(40, 37)
    lora_expand(y, lora_b, token_slot, out, groups=groups)
    torch.testing.assert_close(out.double(), reference_expand(y, lora_b, token_slot,
                                                              torch.zeros(40, 37), 0),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="built for 40 tokens"):
        lora_shrink(x[:39], lora_a, token_slot[:39], scaling, groups=groups)
    with pytest.raises(ValueError, match="pool of 2 slots"):
        lora_expand(y, lora_b[:2], token_slot, out, groups=groups)


def test_bad_shapes_are_refused_with_what_to_change():
    x, lora_a, lora_b, scaling, token_slot = make_case("decode", 4)
    with pytest.raises(ValueError, match="lora_a"):
        lora_shrink(x[:, :-1], lora_a, token_slot, scaling)
    with pytest.raises(ValueError, match="token_slot"):
        lora_shrink(x, lora_a, token_slot.float(), scaling)
    with pytest.raises(ValueError, match="scaling"):
        lora_shrink(x, lora_a, token_slot, scaling[:2])
    with pytest.raises(ValueError, match="max_lora_rank"):
        lora_shrink(x, torch.zeros(3, 129, 50), token_slot, scaling)
    y = torch.zeros(4, 8)
    with pytest.raises(ValueError, match="out_offset"):
        lora_expand(y, lora_b, token_slot, torch.zeros(4, 40), out_offset=4)
    with pytest.raises(ValueError, match="float32"):
        lora_expand(y.half(), lora_b, token_slot, torch.zeros(4, 37))


def test_benchmark_smoke_run_on_cpu(tmp_path, monkeypatch, capsys):
    """``benchmarks/lora_kernels.py --device cpu`` runs its tiny shapes through the
    interpreter, agrees with the per-adapter loop and appends its table."""
    bench = load_benchmark(monkeypatch, "lora_kernels.py")
    results = tmp_path / "RESULTS.md"
    bench.main(["--device", "cpu", "--results", str(results)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert len(rows) > 2
    assert "per-adapter loop" in results.read_text()


# --- GPU: real sizes in bf16 -------------------------------------------------------------

GPU_TOKENS = [1, 7, 64, 512]


def gpu_case(tokens, pattern, hidden, width, seed=0):
    x, lora_a, lora_b, scaling, token_slot = make_case(
        pattern, tokens, slots=8, hidden=hidden, rank=16, width=width, dtype=torch.bfloat16,
        index_dtype=torch.int32, device="cuda", seed=seed)
    return x, lora_a, lora_b, scaling, token_slot


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", GPU_TOKENS)
@pytest.mark.parametrize("pattern", ["decode", "prefill", "random-with-base"])
@pytest.mark.parametrize("hidden,width", [(4096, 14336), (14336, 4096), (4096, 4096)])
def test_gpu_bf16_llama_sizes_match_float64(tokens, pattern, hidden, width):
    x, lora_a, lora_b, scaling, token_slot = gpu_case(tokens, pattern, hidden, width)
    y = lora_shrink(x, lora_a, token_slot, scaling)
    # bf16 products are exact in float32; only the float32 sum over hidden rounds.
    torch.testing.assert_close(y.double(), reference_shrink(x, lora_a, token_slot, scaling),
                               atol=1e-4, rtol=1e-4)
    out = torch.randn(tokens, width + 128, device="cuda", dtype=torch.bfloat16)
    before = out.clone()
    want = reference_expand(y, lora_b, token_slot, out, 64)
    lora_expand(y, lora_b, token_slot, out, 64)
    # y goes through TF32 (10 mantissa bits), the sum is rounded once to bf16 (8 bits): the
    # rounding of bf16 dominates; a wrong slot or a missed row is off by the whole delta
    # (about 1), far outside this.
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)
    base_rows = token_slot < 0
    assert torch.equal(out[base_rows], before[base_rows])
    assert torch.equal(out[:, :64], before[:, :64])
    assert torch.equal(out[:, 64 + width:], before[:, 64 + width:])


@pytest.mark.gpu
def test_gpu_kernels_replay_from_a_cuda_graph_without_host_syncs():
    """Grouping, shrink and expand captured once in a CUDA graph (no host sync allowed while
    capturing) follow new slot assignments written into the same buffers between replays."""
    tokens, hidden, width = 96, 4096, 4096
    x, lora_a, lora_b, scaling, token_slot = gpu_case(tokens, "decode", hidden, width)
    out = torch.zeros(tokens, width, device="cuda", dtype=torch.bfloat16)

    def step() -> None:
        out.zero_()
        groups = group_tokens(token_slot, num_slots=8)
        y = lora_shrink(x, lora_a, token_slot, scaling, groups=groups)
        lora_expand(y, lora_b, token_slot, out, groups=groups)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        # A host sync raises with a message naming the operation, not only a failed capture.
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for pattern in ("prefill", "random-with-base", "base-only", "decode"):
        token_slot.copy_(SLOT_PATTERNS[pattern](tokens, 8).to(token_slot))
        x.normal_()
        graph.replay()
        y = reference_shrink(x, lora_a, token_slot, scaling).float()
        want = reference_expand(y, lora_b, token_slot, torch.zeros_like(out), 0)
        torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=1e-2)

