"""An EAGLE-style draft head: one decoder layer over the target's hidden states.

For position ``t`` the head reads ``fc(concat(embed(token[t+1]), h[t]))``, where ``h[t]`` is
the target's final hidden state at ``t`` (the input of its LM head) and ``embed`` the target's
own embedding; one decoder layer of the target's family (the core's ``LlamaDecoderLayer``:
Llama, Mistral, Qwen2, Qwen3) and a final RMSNorm turn it into ``g[t]``, which stands in for
``h[t+1]``: the target's LM head applied to ``g[t]`` gives the draft distribution of
``token[t+2]``, and ``g[t]`` is the hidden input of the next draft step.

The decoder layer's paged ``Attention`` is swapped for ``HeadAttention``, which attends over
what the caller sets as its ``context``: whole causal sequences (training) or each row's own
cached keys and values plus one new token (drafting, ``CachedRows``).

Checkpoint directory: ``config.json`` (``architectures: ["EagleHead"]``,
``target_architecture``, ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``,
``head_dim``, ``intermediate_size``, ``vocab_size``, ``rms_norm_eps``, ``rope_theta``,
``max_position_embeddings``, optional ``fc_bias``) and ``model.safetensors`` with
``fc.weight`` (``fc.bias``), ``layers.0.*`` in Hugging Face names (``self_attn.q_proj.weight``,
``mlp.gate_proj.weight``, ``input_layernorm.weight``, ...) and ``norm.weight``. The embedding
and LM head are the target's, never stored.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from hitchllm.config import ModelConfig
from hitchllm.layers import load_named_weights
from hitchllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, family_traits
from hitchllm.models.norm import RMSNorm
from hitchllm.models.rope import RotaryEmbedding

HEAD_ARCHITECTURE = "EagleHead"
# Target families whose decoder layer the head reuses.
SUPPORTED_TARGETS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                     "Qwen3ForCausalLM")


class AttentionContext(Protocol):
    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """``q`` [T, heads, d], ``k``/``v`` [T, kv_heads, d] -> [T, heads, d]."""


@dataclass
class CausalSequences:
    """``batch`` equal-length sequences packed row-major: causal attention within each.

    ``first_visible`` [batch] (optional) hides, from the positions at or after it, the keys
    before it: training then sees what drafting sees, a context that starts where decoding
    started (the proposer has no head entries for the prompt)."""

    batch: int
    first_visible: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def split(x: torch.Tensor) -> torch.Tensor:
            return x.view(self.batch, -1, *x.shape[1:]).transpose(1, 2)

        q, k, v = split(q), split(k), split(v)
        if self.first_visible is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            pos = torch.arange(q.shape[2], device=q.device)
            start = self.first_visible.view(-1, 1, 1)
            mask = (pos[None, None, :] <= pos[None, :, None]) & (
                (pos[None, None, :] >= start) | (pos[None, :, None] < start))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None],
                                                 enable_gqa=True)
        return out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3])


@dataclass
class CachedRows:
    """One new token per row, attending over that row's earlier keys/values and itself.

    ``keys``/``values`` [B, L, kv_heads, d] with ``valid`` [B, L] (rows are padded to one
    length); each ``attend`` appends the new token's key/value, so consecutive draft steps
    see each other. The attention is two batched matmuls rather than SDPA: its key length
    grows every draft step, and SDPA's cuDNN kernel (which it picks on an H100 for a masked
    GQA call) builds a plan for every new shape (150 ms each there), while the kernels left
    without cuDNN fall back to its slowest path for this mask."""

    keys: torch.Tensor
    values: torch.Tensor
    valid: torch.Tensor

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.keys = torch.cat([self.keys, k[:, None]], dim=1)
        self.values = torch.cat([self.values, v[:, None]], dim=1)
        self.valid = torch.cat([self.valid, self.valid.new_ones(len(q), 1)], dim=1)
        rows, heads, d = q.shape
        kv_heads = self.keys.shape[2]
        # [B, kv_heads, group, d]: the query heads that share a key/value head side by side.
        grouped = q.view(rows, kv_heads, heads // kv_heads, d)
        # Scores in float32 as SDPA's kernels keep them (bf16 scores lose the softmax).
        scores = (grouped.float() @ self.keys.float().permute(0, 2, 3, 1)) * d**-0.5
        scores = scores.masked_fill(~self.valid[:, None, None, :], float("-inf"))
        probs = scores.softmax(-1).to(self.values.dtype)
        return (probs @ self.values.transpose(1, 2)).view(rows, heads, d)


class HeadAttention(nn.Module):
    """Stands in for the decoder layer's paged ``Attention``: same call, ``context`` decides
    what each query sees."""

    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.context: AttentionContext | None = None

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.context is None:
            raise RuntimeError("EagleHead attention runs only inside EagleHead.forward")
        out = self.context.attend(
            q.view(-1, self.num_heads, self.head_size),
            k.view(-1, self.num_kv_heads, self.head_size),
            v.view(-1, self.num_kv_heads, self.head_size))
        return out.reshape(-1, self.num_heads * self.head_size)


def read_head_config(path: str | Path) -> ModelConfig:
    """The head's ``config.json`` as a one-layer ``ModelConfig`` of its target's architecture;
    ``ValueError`` when the directory is not an EAGLE head checkpoint."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"speculative_model={str(path)!r} is not an EAGLE head checkpoint: it has no "
            "config.json (scripts/train_eagle_head.py writes one)")
    raw = json.loads(config_file.read_text())
    if HEAD_ARCHITECTURE not in (raw.get("architectures") or []):
        raise ValueError(
            f"{config_file} does not describe an EAGLE head (architectures should be "
            f"[{HEAD_ARCHITECTURE!r}]); speculative_method='eagle' needs a head checkpoint")
    target = raw.get("target_architecture")
    if target not in SUPPORTED_TARGETS:
        raise ValueError(
            f"{config_file}: target_architecture {target!r} is not supported; EAGLE heads "
            f"are built for {', '.join(SUPPORTED_TARGETS)}")
    config = ModelConfig.from_pretrained(path)
    return dataclasses.replace(config, architecture=target, num_hidden_layers=1)


class EagleHead(nn.Module):
    """``forward(token_ids [T], hidden [T, H], positions [T]) -> g [T, H]`` (see the module
    docstring); ``embed`` is the target's embedding, called, not stored as a submodule."""

    def __init__(self, config: ModelConfig, embed: Callable[[torch.Tensor], torch.Tensor]) -> None:
        super().__init__()
        self.config = config
        self.embed = embed
        h = config.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bool(config.hf_config.get("fc_bias", False)))
        rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings,
                                 config.rope_theta, config.rope_scaling)
        layer = LlamaDecoderLayer(config, family_traits(config), 0, rotary, None, "layers.0")
        attn = layer.self_attn
        attn.attn = HeadAttention(attn.num_heads, attn.head_dim, attn.num_kv_heads)
        self.layers = nn.ModuleList([layer])
        self.norm = RMSNorm(h, config.rms_norm_eps)

    @property
    def attention(self) -> HeadAttention:
        attn = self.layers[0].self_attn.attn
        assert isinstance(attn, HeadAttention)
        return attn

    def forward(self, token_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                context: AttentionContext) -> torch.Tensor:
        x = self.fc(torch.cat([self.embed(token_ids).to(hidden.dtype), hidden], dim=-1))
        self.attention.context = context
        try:
            out, residual = self.layers[0](positions, x, None)
        finally:
            self.attention.context = None
        return self.norm.add_and_norm(out, residual)[0]

    def load_checkpoint(self, path: str | Path) -> None:
        """Load ``path/model.safetensors``; ``ValueError`` naming missing/unexpected tensors."""
        from safetensors.torch import load_file

        weights = Path(path) / "model.safetensors"
        if not weights.is_file():
            raise ValueError(f"the EAGLE head at {str(path)!r} has no model.safetensors")
        load_named_weights(
            self, load_file(weights).items(), LlamaForCausalLM.STACKED,
            skip=lambda name: "rotary_emb.inv_freq" in name,
            description=f"an EAGLE head ({self.config.architecture})")

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The head's weights under checkpoint names (stacked q/k/v and gate/up split)."""
        attn = self.layers[0].self_attn
        split = {
            "self_attn.qkv_proj": (("q_proj", "k_proj", "v_proj"),
                                   (attn.q_size, attn.kv_size, attn.kv_size)),
            "mlp.gate_up_proj": (("gate_proj", "up_proj"), (self.config.intermediate_size,) * 2),
        }
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            stacked = next((s for s in split if f".{s}." in name), None)
            if stacked is None:
                out[name] = tensor
                continue
            parts, sizes = split[stacked]
            owner = stacked.split(".")[0]
            for part, piece in zip(parts, tensor.split(list(sizes)), strict=True):
                out[name.replace(f".{stacked}.", f".{owner}.{part}.")] = piece
        return {k: v.detach().contiguous() for k, v in out.items()}


def build_head(config: ModelConfig, embed: Callable[[torch.Tensor], torch.Tensor],
               path: str | Path | None, device: torch.device, dtype: torch.dtype) -> EagleHead:
    """An ``EagleHead`` on ``device`` in ``dtype`` (rotary tables stay float32, as in the
    target), with the weights at ``path`` when given (else freshly initialised)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            head = EagleHead(config, embed)
    finally:
        torch.set_default_dtype(previous)
    if path is not None:
        head.load_checkpoint(path)
    return head.eval()


def head_config_json(target: ModelConfig, intermediate_size: int | None = None) -> dict[str, Any]:
    """A head ``config.json`` for ``target``: its attention shape, its MLP width unless
    ``intermediate_size`` is given."""
    hf = target.hf_config
    return {
        "architectures": [HEAD_ARCHITECTURE],
        "target_architecture": target.architecture,
        "hidden_size": target.hidden_size,
        "num_hidden_layers": 1,
        "num_attention_heads": target.num_attention_heads,
        "num_key_value_heads": target.num_key_value_heads,
        "head_dim": target.head_dim,
        "intermediate_size": intermediate_size or target.intermediate_size,
        "vocab_size": target.vocab_size,
        "rms_norm_eps": target.rms_norm_eps,
        "rope_theta": target.rope_theta,
        "rope_scaling": target.rope_scaling,
        "max_position_embeddings": target.max_position_embeddings,
        "attention_bias": bool(hf.get("attention_bias", False)),
        "hidden_act": target.hidden_act,
        "fc_bias": False,
        "torch_dtype": "float32",
    }
