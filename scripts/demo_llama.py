"""The demo model in plain PyTorch: a Llama (RMSNorm, rotary, SwiGLU, grouped-query attention,
tied embeddings) whose ``state_dict`` names and numerics are Hugging Face ``LlamaForCausalLM``'s,
so a checkpoint of its weights loads there unchanged."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """The model's sizes; ``dropout`` applies in training only."""

    vocab_size: int
    hidden_size: int
    layers: int
    heads: int
    kv_heads: int
    intermediate_size: int
    seq_len: int
    rope_theta: float
    dropout: float


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotary_tables(head_dim: int, length: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [length, head_dim], in Hugging Face Llama's rotate-half layout."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    angles = torch.outer(torch.arange(length, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden_size // cfg.heads
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaShape) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        # Training only (the corpus is small and read for many epochs); inference has none.
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.self_attn(self.input_layernorm(x), cos, sin))
        return x + self.dropout(self.mlp(self.post_attention_layernorm(x)))


class Backbone(nn.Module):
    def __init__(self, cfg: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.hidden_size)


class Llama(nn.Module):
    """Causal LM whose ``state_dict`` names are Hugging Face ``LlamaForCausalLM``'s."""

    def __init__(self, cfg: LlamaShape) -> None:
        super().__init__()
        self.model = Backbone(cfg)
        cos, sin = rotary_tables(cfg.hidden_size // cfg.heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self._init_weights(cfg)

    def _init_weights(self, cfg: LlamaShape) -> None:
        for name, p in self.named_parameters():
            if p.dim() == 2:
                # Residual-branch outputs shrink with depth so the stream's scale stays put.
                scale = (2 * cfg.layers) ** -0.5 if name.endswith(("o_proj.weight",
                                                                   "down_proj.weight")) else 1.0
                nn.init.normal_(p, std=0.02 * scale)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits [batch, time, vocab]; the output projection is the embedding (tied)."""
        t = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            x = layer(x, self.cos[:t], self.sin[:t])
        return F.linear(self.model.norm(x), self.model.embed_tokens.weight)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())
