"""Each tensor-parallel rank loads exactly its slices of the checkpoint through the weight
loaders: its query heads, its KV heads (replicated when there are fewer than ranks), its MLP
rows and columns, its vocabulary rows (the last partition padded with zeros), and the
replicated norms whole. Each rank is built in ``distributed.tensor_parallel`` (no process
group is needed to load) and compared with the safetensors file read directly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from tp_support import qwen3_gqa_path  # noqa: F401

from hitchllm import distributed
from hitchllm.config import ModelConfig
from hitchllm.models.loader import load_model
from hitchllm.plugins import get_plugin_registry

WORLD = 2


def rank_model(path: str, rank: int) -> torch.nn.Module:
    with distributed.tensor_parallel(rank, WORLD):
        return load_model(ModelConfig.from_pretrained(path), get_plugin_registry(),
                          torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("rank", range(WORLD))
def test_each_rank_holds_its_slices_of_the_checkpoint(qwen3_gqa_path, rank):  # noqa: F811
    ckpt = load_file(f"{qwen3_gqa_path}/model.safetensors")
    config = ModelConfig.from_pretrained(qwen3_gqa_path)
    model = rank_model(qwen3_gqa_path, rank)
    params = dict(model.named_parameters())
    d = config.head_dim
    q_rows = config.num_attention_heads // WORLD * d
    mlp = config.intermediate_size // WORLD
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        attn, ffn = f"{layer}.self_attn", f"{layer}.mlp"
        q = ckpt[f"{attn}.q_proj.weight"][rank * q_rows:(rank + 1) * q_rows]
        # One KV head for two ranks: both hold it whole.
        assert config.num_key_value_heads == 1
        expected_qkv = torch.cat([q, ckpt[f"{attn}.k_proj.weight"], ckpt[f"{attn}.v_proj.weight"]])
        assert torch.equal(params[f"{attn}.qkv_proj.weight"], expected_qkv)
        assert torch.equal(params[f"{attn}.o_proj.weight"],
                           ckpt[f"{attn}.o_proj.weight"][:, rank * q_rows:(rank + 1) * q_rows])
        rows = slice(rank * mlp, (rank + 1) * mlp)
        assert torch.equal(params[f"{ffn}.gate_up_proj.weight"],
                           torch.cat([ckpt[f"{ffn}.gate_proj.weight"][rows],
                                      ckpt[f"{ffn}.up_proj.weight"][rows]]))
        assert torch.equal(params[f"{ffn}.down_proj.weight"],
                           ckpt[f"{ffn}.down_proj.weight"][:, rows])
        for norm in (f"{attn}.q_norm.weight", f"{attn}.k_norm.weight",
                     f"{layer}.input_layernorm.weight"):
            assert torch.equal(params[norm], ckpt[norm])
    # 515 vocabulary rows: partitions of 258; rank 1 holds 257 and one zero row of padding.
    embed = ckpt["model.embed_tokens.weight"]
    assert config.vocab_size == 515
    part = params["model.embed_tokens.weight"]
    assert part.shape == (258, config.hidden_size)
    real = embed[rank * 258:(rank + 1) * 258]
    assert torch.equal(part[: len(real)], real)
    assert not part[len(real):].any()
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    # The rank reads only its share: about half the parameters of the whole model.
    assert sum(p.numel() for p in params.values()) < 0.6 * sum(t.numel() for t in ckpt.values())
