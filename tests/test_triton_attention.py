"""TRITON_ATTN against a float64 reference over paged caches with permuted blocks (CPU:
Triton's interpreter, small shapes, float32; GPU: real sizes in bf16), and end to end."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_reference import make_batch, reference_attention
from test_models_hf_parity import mixed_prompts, run

pytest.importorskip("hitchllm_attention_triton")

from hitchllm import LLM
from hitchllm.attention import AttentionSpec
from hitchllm_attention_triton import TritonAttentionBackend

CASES = {
    "prefill": ([0, 0, 0], [5, 17, 1]),
    "chunked-prefill-over-cached-prefix": ([8, 13], [7, 4]),
    "decode": ([1, 9, 31, 16], [1, 1, 1, 1]),
    "mixed": ([0, 12, 40, 3], [9, 1, 6, 1]),
}


def run_triton(context_lens, query_lens, num_heads, num_kv_heads, head_size=16, block_size=4,
               dtype=torch.float32, device="cpu", splits=None, sliding_window=None,
               soft_cap=None, num_blocks=None, seed=0, longest_first=None, cuda_graph=False,
               order=None, decodes_apart=None):
    spec = AttentionSpec(device_type=torch.device(device).type, dtype=dtype,
                         kv_cache_dtype=dtype, head_size=head_size, num_heads=num_heads,
                         num_kv_heads=num_kv_heads, block_size=block_size,
                         sliding_window=sliding_window, logits_soft_cap=soft_cap)
    if num_blocks is None:  # room for every request's pages, plus spares to permute among
        num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 8
    cache = torch.zeros(TritonAttentionBackend.get_kv_cache_shape(
        num_blocks, block_size, num_kv_heads, head_size), dtype=dtype, device=device)

    def write(slots, k, v):
        cache[0].view(-1, num_kv_heads, head_size)[slots] = k
        cache[1].view(-1, num_kv_heads, head_size)[slots] = v

    batch = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_size,
                       block_size, num_blocks, cache, dtype, seed=seed, write_context=write)
    scale = head_size**-0.5
    builder = TritonAttentionBackend.get_builder_cls()(spec, torch.device(device))
    builder.force_num_splits = splits
    if longest_first is not None:
        builder.longest_first = longest_first
    if decodes_apart is not None:
        builder.decodes_apart = decodes_apart
    meta = builder.build(dataclasses.replace(batch.common, cuda_graph=cuda_graph))
    if order is not None:  # in place of the builder's (decode batches)
        meta.order = order
    impl = TritonAttentionBackend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, spec)
    out = impl.forward(batch.query, batch.key, batch.value, cache, meta)
    ref = reference_attention(batch, scale, sliding_window, soft_cap, dtype)
    return out, ref, cache, batch


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["gqa1", "gqa2", "gqa4"])
def test_triton_matches_float64_reference(case, heads):
    out, ref, _, _ = run_triton(*CASES[case], *heads)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [16, 3])
def test_partial_last_blocks_and_other_block_sizes(block_size):
    out, ref, _, _ = run_triton([5, 0, 20], [3, 19, 1], 4, 2, block_size=block_size)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("splits", [2, 3, 5])
def test_split_kv_decode_matches_reference_and_unsplit(splits):
    ctx, q = [37, 5, 64], [1, 1, 1]
    out, ref, _, _ = run_triton(ctx, q, 8, 2, splits=splits)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    unsplit, _, _, _ = run_triton(ctx, q, 8, 2, splits=1)
    torch.testing.assert_close(out, unsplit, atol=1e-5, rtol=1e-5)


@pytest.fixture
def built(monkeypatch):
    """The metadata of every TRITON_ATTN build, in order."""
    from hitchllm_attention_triton.backend import TritonAttentionMetadataBuilder

    metadata = []
    build = TritonAttentionMetadataBuilder.build
    monkeypatch.setattr(TritonAttentionMetadataBuilder, "build",
                        lambda self, common: metadata.append(build(self, common)) or metadata[-1])
    return metadata


@pytest.mark.parametrize("window", [None, 7], ids=["full", "window"])
def test_a_prompt_steps_decodes_apart_match_the_reference(built, window):
    """A prompt step whose one-token requests fill two waves (the interpreter's builder counts
    4 SMs: more than 4 of them at 2 KV heads) runs them in a decode launch of their own,
    longest first, and the prompt tiles over the rest; both agree with the float64 reference
    and with the one launch over every tile. A one-token prompt (no context) counts too."""
    ctx = [12, 0, 40, 3, 25, 9, 0, 17, 30, 5]
    q = [1, 9, 1, 1, 1, 6, 1, 1, 1, 1]
    out, ref, _, _ = run_triton(ctx, q, 8, 2, decodes_apart=True, sliding_window=window)
    meta = built[-1]
    assert meta.decode_reqs is not None and meta.decode_kernel.block_q == 1
    decoding = [i for i, n in enumerate(q) if n == 1]
    assert meta.decode_reqs.tolist() == sorted(decoding, key=lambda i: -ctx[i])
    assert sorted(meta.tile_req[: meta.num_tiles].tolist()) == [1, 1, 1, 5, 5]  # 4-query tiles
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    together, _, _, _ = run_triton(ctx, q, 8, 2, decodes_apart=False, sliding_window=window)
    assert built[-1].decode_reqs is None
    torch.testing.assert_close(out, together, atol=1e-5, rtol=1e-5)


def test_a_few_decodes_stay_in_the_prompt_tiles(built):
    out, ref, _, _ = run_triton([12, 0, 40, 3, 25], [1, 9, 1, 1, 1], 8, 2, decodes_apart=True)
    assert built[-1].decode_reqs is None  # 4 decodes x 2 KV heads: one wave of 4 SMs, twice
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def _decode_order(builder, context_lens, cuda_graph=False):
    """The request order ``builder`` gives a decode step over ``context_lens``."""
    n, kv_heads, head_size, block_size = len(context_lens), 2, 16, 4
    num_blocks = sum(-(-(c + 1) // block_size) for c in context_lens)
    cache = torch.zeros(TritonAttentionBackend.get_kv_cache_shape(
        num_blocks, block_size, kv_heads, head_size))
    batch = make_batch(context_lens, [1] * n, 8, kv_heads, head_size, block_size, num_blocks,
                       cache, torch.float32, write_context=lambda *_: None)
    order = builder.build(dataclasses.replace(batch.common, cuda_graph=cuda_graph)).order
    return None if order is None else order.clone(), order


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("cuda_graph", [False, True], ids=["eager", "graph"])
def test_decode_programs_take_the_longest_contexts_first(splits, cuda_graph):
    """Past two waves of SMs (the interpreter's builder counts 4 SMs) the decode kernel's
    programs take requests longest first, each request's KV heads together; the output is the
    index-order kernel's, bit for bit. A CUDA-graph batch sorts into buffers kept per size."""
    ctx = [3, 40, 1, 25, 9, 17, 40]
    args = (ctx, [1] * len(ctx), 8, 2)
    out, ref, _, _ = run_triton(*args, splits=splits, longest_first=True, cuda_graph=cuda_graph)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    by_index, _, _, _ = run_triton(*args, splits=splits, longest_first=False)
    assert torch.equal(out, by_index)

    spec = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=16, num_heads=8, num_kv_heads=2, block_size=4)
    builder = TritonAttentionBackend.get_builder_cls()(spec, torch.device("cpu"))
    builder.force_num_splits = splits
    assert _decode_order(builder, ctx, cuda_graph)[0] is None  # off by default on the CPU
    builder.longest_first = True
    order, buffer = _decode_order(builder, ctx, cuda_graph)
    assert order.tolist() == [1, 6, 3, 5, 4, 0, 2]  # stable: request 1 before request 6
    again, again_buffer = _decode_order(builder, [9, 1, 2, 3, 4, 5, 6], cuda_graph)
    assert again.tolist() == [0, 6, 5, 4, 3, 2, 1]
    # A graph replays the buffer it was captured with: the same one, refilled.
    assert (again_buffer.data_ptr() == buffer.data_ptr()) == cuda_graph
    # One wave or less (2 requests x 2 KV heads x splits <= 2 x 4 SMs): index order.
    assert _decode_order(builder, [30, 2], cuda_graph)[0] is None


def test_decode_programs_follow_the_order_they_are_given(monkeypatch):
    """The kernel reads each program's request from the order (any permutation gives the same
    output, so an order naming request 3 for every program tells whether it is read): only
    request 3's output is written, and it is the reference's."""
    ctx = [3, 40, 1, 25, 9, 17, 40]
    n = len(ctx)
    # The impl's output starts as torch.empty_like(query): filled with 7.0 here instead.
    monkeypatch.setattr(torch, "empty_like", lambda t: torch.full_like(t, 7.0))
    out, ref, _, _ = run_triton(ctx, [1] * n, 8, 2, longest_first=True,
                                order=torch.full((n,), 3, dtype=torch.int64))
    torch.testing.assert_close(out[3].double(), ref[3], atol=1e-5, rtol=1e-5)
    assert (out[torch.arange(n) != 3] == 7.0).all()


def test_new_keys_and_values_land_in_their_slots_and_padding_is_skipped():
    _, _, cache, batch = run_triton([0, 12], [9, 1], 4, 2)
    slots = batch.common.slot_mapping
    torch.testing.assert_close(cache[0].view(-1, 2, 16)[slots], batch.key)
    torch.testing.assert_close(cache[1].view(-1, 2, 16)[slots], batch.value)
    # A padding slot (-1) writes nothing.
    from hitchllm_attention_triton import kernels

    before = cache.clone()
    key = torch.ones(2, 32)
    kernels.write_kv_cache[(2,)](key, key, cache, torch.tensor([-1, -1]), None, None, 32, 32,
                                cache.stride(0), TOKEN_SIZE=32, TOKEN_PAD=32)
    assert torch.equal(cache, before)


def test_sliding_window_soft_cap_and_odd_head_size():
    out, ref, _, _ = run_triton(*CASES["mixed"], 4, 2, sliding_window=5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out, ref, _, _ = run_triton(*CASES["mixed"], 4, 2, soft_cap=2.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out, ref, _, _ = run_triton(*CASES["prefill"], 4, 2, head_size=24)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_validate_explains_what_it_cannot_serve(monkeypatch):
    spec = AttentionSpec(device_type="cpu", dtype=torch.bfloat16, kv_cache_dtype=torch.bfloat16,
                         head_size=512, num_heads=8, num_kv_heads=2, block_size=16, use_mla=True)
    reasons = " ".join(TritonAttentionBackend.validate(spec))
    assert "MLA" in reasons and "512" in reasons and "interpreter" in reasons
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    fp32 = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=64, num_heads=8, num_kv_heads=2, block_size=16)
    assert "TRITON_INTERPRET=1" in " ".join(TritonAttentionBackend.validate(fp32))


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_engine_greedy_tokens_equal_torch_backend(tiny_models, arch):
    path = tiny_models[arch]
    prompts = mixed_prompts(5, lengths=(3, 11, 26))
    expected = run(LLM(path, block_size=4, attention_backend="TORCH"), prompts, max_tokens=6)
    llm = LLM(path, block_size=4, attention_backend="TRITON_ATTN", max_num_batched_tokens=16,
              num_kv_blocks=14)
    assert run(llm, prompts, max_tokens=6) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    ([0] * 4, [512, 300, 77, 1000]),
    ([1500, 2048, 0, 700], [512, 1, 333, 1]),
    ([2047] * 32, [1] * 32),
])
@pytest.mark.parametrize("heads", [(32, 8), (32, 4), (16, 16)])
def test_gpu_bf16_real_sizes(case, heads):
    for block_size in (16, 32):
        out, ref, _, _ = run_triton(*case, *heads, head_size=128, block_size=block_size,
                                    dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("decodes, shortest", [(80, 1), (50, 600)], ids=["tiles64", "tiles128"])
def test_gpu_prompt_step_with_decodes_apart(built, decodes, shortest):
    """A prompt step with 50 or 80 decoding requests of 8 KV heads (past two waves of an
    H100's SMs; 50 with contexts long enough for 128-token tiles): their own decode launch,
    checked against the reference."""
    import random

    rng = random.Random(0)
    ctx = [0, 300] + [rng.randint(shortest, 2000) for _ in range(decodes)]
    q = [700, 200] + [1] * decodes
    out, ref, _, _ = run_triton(ctx, q, 16, 8, head_size=128, block_size=16,
                                dtype=torch.bfloat16, device="cuda")
    assert built[-1].decode_reqs is not None
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)
    together, _, _, _ = run_triton(ctx, q, 16, 8, head_size=128, block_size=16,
                                   dtype=torch.bfloat16, device="cuda", decodes_apart=False)
    assert built[-1].decode_reqs is None
    torch.testing.assert_close(out, together, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 96, 256])
def test_gpu_other_head_sizes(head_size):
    for case in (([0, 700], [300, 1]), ([2047] * 8, [1] * 8)):
        out, ref, _, _ = run_triton(*case, 16, 4, head_size=head_size, block_size=16,
                                    dtype=torch.bfloat16, device="cuda")
        torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [None, 4, 7])
def test_gpu_split_kv_long_context(splits):
    out, ref, _, _ = run_triton([32767, 9000], [1, 1], 32, 8, head_size=128, block_size=16,
                                dtype=torch.bfloat16, device="cuda",
                                splits=splits)
    torch.testing.assert_close(out.double().cpu(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_gpu_engine_tokens_track_torch_backend(tiny_models):
    path = tiny_models["Qwen3ForCausalLM"]
    prompts = mixed_prompts(6, lengths=(3, 40, 70))
    ref = run(LLM(path, device="cuda", attention_backend="TORCH"), prompts, max_tokens=4)
    got = run(LLM(path, device="cuda", attention_backend="TRITON_ATTN"), prompts, max_tokens=4)
    assert [g[:2] for g in got] == [r[:2] for r in ref]


def test_decode_split_counts_are_few_powers_of_two():
    """The split count is a kernel constexpr, so every distinct value compiles the kernel
    anew: an eager run whose batches shrink and contexts grow must meet only a handful."""
    from hitchllm_attention_triton.config import choose_kernel_config

    seen = set()
    for num_reqs in range(1, 257):
        for max_seq_len in range(1, 8193, 37):
            cfg = choose_kernel_config(num_reqs=num_reqs, max_query_len=1,
                                       max_seq_len=max_seq_len, num_kv_heads=8, group=4,
                                       head_size=128, num_sms=132, on_gpu=True)
            seen.add(cfg.num_splits)
            assert cfg.num_splits == 1 or cfg.num_splits * 4 * cfg.block_n <= max_seq_len
    assert seen == {1, 2, 4, 8, 16}


def test_warm_up_steps_write_nothing_and_change_no_tokens(tiny_models, monkeypatch):
    """The start-up steps (``ModelRunner.warm_up``; the engine runs them on CUDA) go through
    every query length the backend names on the live cache without writing to it: the cache
    is the same after them, and requests generate the same tokens."""
    llm = LLM(tiny_models["Qwen3ForCausalLM"], attention_backend="TRITON_ATTN",
              dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    prompts = mixed_prompts(4, lengths=(3, 11, 26))
    expected = run(llm, prompts, max_tokens=5)
    runner = llm.engine.executor.runner
    before = [cache.clone() for cache in runner.kv_caches]
    longest = []
    build = runner.builder.build
    monkeypatch.setattr(runner.builder, "build",
                        lambda common: longest.append(common.max_query_len) or build(common))
    runner.warm_up()
    assert longest == list(TritonAttentionBackend.warm_up_query_lens) == list(range(1, 10))
    assert all(torch.equal(a, b) for a, b in zip(before, runner.kv_caches, strict=True))
    monkeypatch.undo()
    assert run(llm, prompts, max_tokens=5) == expected


def test_warm_up_meets_every_lm_head_row_count_without_query_lengths(tiny_models, monkeypatch):
    """A backend that names no query lengths (TORCH) still gets one step, then the LM head at
    every row count up to ``max_num_seqs``, largest first (cuBLAS meets each on CUDA), and one
    plain temperature sample (the race kernel compiles there on CUDA), drawn from a generator
    of its own: the engine's seeded stream is untouched."""
    llm = LLM(tiny_models["Qwen3ForCausalLM"], attention_backend="TORCH", dtype="float32",
              seed=11, max_num_seqs=6)
    runner = llm.engine.executor.runner
    state = runner.default_generator.get_state()
    sampled, heads = [], []
    sample = runner.sampler.forward
    monkeypatch.setattr(runner.sampler, "forward",
                        lambda logits, metadata: sampled.append(len(logits))
                        or sample(logits, metadata))
    head = runner.model.compute_logits
    monkeypatch.setattr(runner.model, "compute_logits",
                        lambda hidden: heads.append(len(hidden)) or head(hidden))
    runner.warm_up()
    assert heads == [6, 5, 4, 3, 2, 1] and sampled == [6]
    assert torch.equal(runner.default_generator.get_state(), state)
