"""TORCH_MLA against a float64 reference of multi-head latent attention (prefill, a chunk over
a cached prefix, decodes in one step: the expanded and the absorbed forms), DeepSeek's rope
and softmax scale against transformers'."""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers.models.deepseek_v2 import modeling_deepseek_v2 as hf_v2
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_v3

pytest.importorskip("hitchllm_attention_mla")

from hitchllm.attention import AttentionSpec, CommonAttentionMetadata, set_forward_context
from hitchllm.layers import ColumnParallelLinear, UnquantizedLinearMethod
from hitchllm_attention_mla import MLAAttention, MLADims, TorchMLABackend
from hitchllm_attention_mla.rope import DeepseekRotaryEmbedding, softmax_scale

DIMS = MLADims(num_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=12)
BLOCK, NUM_BLOCKS = 4, 24
# (tokens cached before the step, new tokens): a prompt, a chunk over a cached prefix, decodes.
REQUESTS = [(0, 6), (9, 3), (10, 1), (5, 1)]


def reference_attention(q: torch.Tensor, latents: torch.Tensor, w_kv: torch.Tensor,
                        context_len: int, scale: float) -> torch.Tensor:
    """Float64 MLA of one request, written from the definition: per-head keys and values
    up-projected from every latent, causal softmax with the cached prefix as offset."""
    d = DIMS
    q, latents, w_kv = q.double(), latents.double(), w_kv.double()
    c_kv, k_pe = latents[:, : d.kv_lora_rank], latents[:, d.kv_lora_rank:]
    kv = (c_kv @ w_kv.T).view(len(latents), d.num_heads, -1)
    k = torch.cat((kv[..., : d.qk_nope_head_dim],
                   k_pe[:, None].expand(-1, d.num_heads, -1)), dim=-1)
    v = kv[..., d.qk_nope_head_dim:]
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = context_len + torch.arange(len(q))[:, None]
    scores = scores.masked_fill(torch.arange(len(latents))[None] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_torch_mla_matches_float64_reference():
    torch.manual_seed(0)
    d, scale = DIMS, 0.3
    kv_b_proj = ColumnParallelLinear(d.kv_lora_rank, d.num_heads * (d.qk_nope_head_dim
                                                                    + d.v_head_dim))
    with torch.no_grad():
        kv_b_proj.weight.normal_(0, 0.3)
    layer = MLAAttention(d, scale, 0, kv_b_proj)
    spec = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=d.latent_width, num_heads=d.num_heads, num_kv_heads=1,
                         block_size=BLOCK, use_mla=True)
    kv_spec = layer.get_kv_cache_spec(BLOCK, torch.float32)
    cache = torch.zeros(TorchMLABackend.get_kv_cache_shape_for_spec(NUM_BLOCKS, kv_spec))
    impl = TorchMLABackend.get_impl_cls()(d.num_heads, d.latent_width, scale, 1, spec)
    layer.bind(impl, cache)

    # Each request owns shuffled blocks; its cached prefix is written through them first.
    perm = torch.randperm(NUM_BLOCKS)
    cols = 5
    block_table = perm[: len(REQUESTS) * cols].view(len(REQUESTS), cols).int()
    slots = [block_table[i, torch.arange(c + n) // BLOCK].long() * BLOCK
             + torch.arange(c + n) % BLOCK for i, (c, n) in enumerate(REQUESTS)]
    latents = [torch.randn(c + n, d.latent_width) for c, n in REQUESTS]
    for s, lat, (c, _) in zip(slots, latents, REQUESTS):
        TorchMLABackend.get_impl_cls().write_latents(cache, lat[:c], s[:c])

    queries = [torch.randn(n, d.num_heads, d.qk_head_dim) for _, n in REQUESTS]
    query_lens = torch.tensor([n for _, n in REQUESTS], dtype=torch.int32)
    context = torch.tensor([c for c, _ in REQUESTS], dtype=torch.int32)
    qsl = torch.cat((torch.zeros(1, dtype=torch.int32), query_lens.cumsum(0).int()))
    common = CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=context + query_lens,
        seq_lens_cpu=context + query_lens, num_computed_tokens_cpu=context,
        block_table=block_table,
        slot_mapping=torch.cat([s[c:] for s, (c, _) in zip(slots, REQUESTS)]),
        num_reqs=len(REQUESTS), num_actual_tokens=int(qsl[-1]),
        max_query_len=int(query_lens.max()), max_seq_len=int((context + query_lens).max()))
    metadata = TorchMLABackend.get_builder_cls()(spec, torch.device("cpu")).build(common)
    assert metadata.prefills and metadata.batched is not None  # both forms run

    q = torch.cat(queries)
    new = torch.cat([lat[c:] for lat, (c, _) in zip(latents, REQUESTS)])
    q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
    c_kv, k_pe = new.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
    with set_forward_context(metadata):
        out = layer(q_nope, q_pe, c_kv, k_pe).view(len(q), d.num_heads, d.v_head_dim)

    expected = torch.cat([reference_attention(qr, lat, kv_b_proj.weight, c, scale)
                          for qr, lat, (c, _) in zip(queries, latents, REQUESTS)])
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def _hf_config(arch: str, **fields):
    cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    return cls(hidden_size=64, num_attention_heads=4, kv_lora_rank=32, qk_nope_head_dim=16,
               qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=256, **fields)


YARN = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 16, "beta_slow": 2}


@pytest.mark.parametrize("arch,fields", [
    ("DeepseekV2ForCausalLM", {"rope_scaling": YARN}),
    ("DeepseekV3ForCausalLM", {"rope_scaling": YARN}),
    ("DeepseekV3ForCausalLM", {"rope_interleave": False}),
])
def test_rope_and_softmax_scale_match_transformers(arch, fields):
    """Rotated query-key products (the layout of the rotated pairs may differ; products may
    not) and the softmax scale equal transformers'."""
    config = _hf_config(arch, **fields)
    scaling = fields.get("rope_scaling")
    interleaved = arch == "DeepseekV2ForCausalLM" or config.rope_interleave
    ours = DeepseekRotaryEmbedding(8, 256, 10000.0, scaling, interleaved)
    positions = torch.tensor([0, 3, 17, 100, 255])
    torch.manual_seed(1)
    q, k = torch.randn(5, 4, 8), torch.randn(5, 8)
    q_ours, k_ours = ours(positions, q, k)
    hf_q, hf_k = q.transpose(0, 1)[None], k[None, None]  # [1, heads, T, d], [1, 1, T, d]
    if arch == "DeepseekV2ForCausalLM":
        freqs = hf_v2.DeepseekV2RotaryEmbedding(config)(q, positions[None])
        q_hf, k_hf = hf_v2.apply_rotary_emb(hf_q, hf_k, freqs)
        hf_scale = hf_v2.DeepseekV2Attention(config, 0).scaling
    else:
        cos, sin = hf_v3.DeepseekV3RotaryEmbedding(config)(q, positions[None])
        rotate = (hf_v3.apply_rotary_pos_emb_interleave if config.rope_interleave
                  else hf_v3.apply_rotary_pos_emb)
        q_hf, k_hf = rotate(hf_q, hf_k, cos, sin)
        hf_scale = hf_v3.DeepseekV3Attention(config, 0).scaling
    torch.testing.assert_close(torch.einsum("thd,sd->hts", q_ours, k_ours),
                               q_hf[0] @ k_hf[0, 0].T, rtol=1e-5, atol=1e-5)
    assert softmax_scale(24, scaling) == pytest.approx(hf_scale, rel=1e-12)


class _ScaledLinearMethod(UnquantizedLinearMethod):
    """Stands for any method that applies more than the plain weight (a quantization, LoRA)."""

    def apply(self, layer, x, bias=None):
        return 2 * super().apply(layer, x, bias)


class _ScaleKvB:
    def get_linear_method(self, layer, prefix):
        return _ScaledLinearMethod() if prefix.endswith("kv_b_proj") else None


def test_binding_refuses_a_kv_b_proj_that_is_not_a_plain_weight():
    d = DIMS
    kv_b_proj = ColumnParallelLinear(d.kv_lora_rank,
                                     d.num_heads * (d.qk_nope_head_dim + d.v_head_dim),
                                     quant_config=_ScaleKvB(), prefix="self_attn.kv_b_proj")
    layer = MLAAttention(d, 0.3, 0, kv_b_proj)
    spec = AttentionSpec(device_type="cpu", dtype=torch.float32, kv_cache_dtype=torch.float32,
                         head_size=d.latent_width, num_heads=d.num_heads, num_kv_heads=1,
                         block_size=BLOCK, use_mla=True)
    impl = TorchMLABackend.get_impl_cls()(d.num_heads, d.latent_width, 0.3, 1, spec)
    with pytest.raises(ValueError, match="plain kv_b_proj.*_ScaledLinearMethod"):
        layer.bind(impl, torch.zeros(2, BLOCK, d.latent_width))
