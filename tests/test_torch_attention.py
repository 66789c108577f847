"""The TORCH backend against a float64 reference over paged caches with permuted blocks."""

from __future__ import annotations

import pytest
import torch
from attention_reference import make_batch, reference_attention

from hitchllm.attention import AttentionSpec, TorchAttentionBackend

CASES = {
    "prefill": ([0, 0, 0], [5, 17, 1]),
    "chunked-prefill-over-cached-prefix": ([8, 13], [7, 4]),
    "decode": ([1, 9, 31, 16], [1, 1, 1, 1]),
    "mixed": ([0, 12, 40, 3], [9, 1, 6, 1]),
}


def run_torch_backend(case, num_heads, num_kv_heads, block_size=4, head_size=16,
                      dtype=torch.float32, sliding_window=None, soft_cap=None):
    context_lens, query_lens = CASES[case]
    spec = AttentionSpec(device_type="cpu", dtype=dtype, kv_cache_dtype=dtype,
                         head_size=head_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         block_size=block_size, sliding_window=sliding_window,
                         logits_soft_cap=soft_cap)
    num_blocks = 40
    cache = torch.zeros(TorchAttentionBackend.get_kv_cache_shape(
        num_blocks, block_size, num_kv_heads, head_size), dtype=dtype)

    def write(slots, k, v):  # TORCH's layout is head-major: [kv_heads, slot, d]
        cache[0].view(num_kv_heads, -1, head_size)[:, slots] = k.transpose(0, 1)
        cache[1].view(num_kv_heads, -1, head_size)[:, slots] = v.transpose(0, 1)

    batch = make_batch(context_lens, query_lens, num_heads, num_kv_heads, head_size,
                       block_size, num_blocks, cache, dtype, write_context=write)
    scale = head_size**-0.5
    impl = TorchAttentionBackend.get_impl_cls()(num_heads, head_size, scale, num_kv_heads, spec)
    meta = TorchAttentionBackend.get_builder_cls()(spec, torch.device("cpu")).build(batch.common)
    out = impl.forward(batch.query, batch.key, batch.value, cache, meta)
    ref = reference_attention(batch, scale, sliding_window, soft_cap, dtype)
    return out, ref, cache, batch


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
def test_torch_backend_matches_float64_reference(case, heads):
    out, ref, _, _ = run_torch_backend(case, *heads)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_new_keys_and_values_land_in_their_slots():
    _, _, cache, batch = run_torch_backend("mixed", 4, 2)
    slots = batch.common.slot_mapping
    for i, new in enumerate((batch.key, batch.value)):
        stored = cache[i].view(2, -1, 16)[:, slots].transpose(0, 1)
        torch.testing.assert_close(stored.double(), new.double())


def test_padding_slots_are_not_written():
    spec = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=8, num_heads=2, num_kv_heads=2, block_size=4)
    cache = torch.zeros(TorchAttentionBackend.get_kv_cache_shape(3, 4, 2, 8))
    common_slots = torch.tensor([5, -1, 6])
    from hitchllm.attention import CommonAttentionMetadata

    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, 3], dtype=torch.int32),
        query_start_loc_cpu=torch.tensor([0, 3], dtype=torch.int32),
        seq_lens=torch.tensor([3], dtype=torch.int32),
        seq_lens_cpu=torch.tensor([3], dtype=torch.int32),
        num_computed_tokens_cpu=torch.tensor([0], dtype=torch.int32),
        block_table=torch.tensor([[1]], dtype=torch.int32), slot_mapping=common_slots,
        num_reqs=1, num_actual_tokens=3, max_query_len=3, max_seq_len=3)
    impl = TorchAttentionBackend.get_impl_cls()(2, 8, 1.0, 2, spec)
    meta = TorchAttentionBackend.get_builder_cls()(spec, torch.device("cpu")).build(common)
    k = torch.ones(3, 2, 8)
    impl.forward(torch.ones(3, 2, 8), k, k, cache, meta)
    per_slot = cache[0, :, :3].reshape(2, -1, 8).abs().sum(dim=(0, 2))
    assert per_slot.nonzero().flatten().tolist() == [5, 6]  # only real slots of real blocks


def test_sliding_window_and_soft_cap_match_reference():
    out, ref, _, _ = run_torch_backend("mixed", 4, 2, sliding_window=5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    out, ref, _, _ = run_torch_backend("mixed", 4, 2, soft_cap=2.0)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_half_precision_within_rounding():
    out, ref, _, _ = run_torch_backend("mixed", 8, 2, dtype=torch.bfloat16)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_prompt_attention_never_asks_cudnn(monkeypatch):
    """Prompts and chunks run SDPA with cuDNN's kernel switched off: on an H100 SDPA picked it
    for GQA prompts and built a plan for every new prompt length (100-190 ms each). SDPA's
    backend switches are process-wide, so the CPU sees them; they come back after the call."""
    import hitchllm.attention.torch_backend as tb

    sdpa, calls = tb.F.scaled_dot_product_attention, []

    def checked(*args, **kwargs):
        calls.append(torch.backends.cuda.cudnn_sdp_enabled())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(tb.F, "scaled_dot_product_attention", checked)
    out, ref, _, _ = run_torch_backend("mixed", 8, 2)  # whole prompts and chunks over a prefix
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    assert len(calls) == 2 and not any(calls)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_cudnn_switch_is_shared_by_overlapping_blocks():
    """Two engines' steps on two threads overlap: cuDNN's SDPA kernel stays off until the last
    block leaves, then comes back as it was (off, if the user had turned it off)."""
    from contextlib import ExitStack

    from hitchllm.attention.torch_backend import without_cudnn_sdpa

    for user_setting in (True, False):
        torch.backends.cuda.enable_cudnn_sdp(user_setting)
        try:
            first, second = ExitStack(), ExitStack()
            first.enter_context(without_cudnn_sdpa())
            second.enter_context(without_cudnn_sdpa())
            first.close()  # the first engine's step ends while the second's runs
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            second.close()
            assert torch.backends.cuda.cudnn_sdp_enabled() == user_setting
        finally:
            torch.backends.cuda.enable_cudnn_sdp(True)
