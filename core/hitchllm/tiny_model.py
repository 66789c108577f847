"""Tiny random-weight checkpoints for tests, demos and the Quickstart, built fully offline.

``build_tiny_checkpoint(path, "LlamaForCausalLM")`` writes a Hugging Face checkpoint directory
(config.json, model.safetensors, tokenizer files with a chat template) whose model has random
weights and whose tokenizer is a byte-level BPE trained here on a small built-in corpus. The
output is deterministic for a given seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
# Mixture-of-experts members of the family (built on request; not in the dense test matrix).
MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
# Small expert layers: 8 (Qwen3-MoE) or 4 (Mixtral) experts, top-2; Qwen3-MoE's middle layer
# of three is dense (mlp_only_layers), as its configs allow.
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "Qwen3MoeForCausalLM": dict(num_hidden_layers=3, num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=32, norm_topk_prob=True,
                                mlp_only_layers=[1]),
    "MixtralForCausalLM": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
}

_TEXT = """
def add(a, b):
    return a + b

class Engine:
    def step(self):
        for request in self.running:
            yield request.next_token()

import os
import sys

if __name__ == "__main__":
    print("hello")

Simple is better than complex, and readable code is written for the next engineer.
A language model reads a prompt, one token at a time, and writes what comes next.
User: What is the capital of France? Assistant: The capital of France is Paris.

The quick brown fox jumps over the lazy dog. Hello, world! Once upon a time there was a
small engine that served language models. It kept its memory in blocks, shared the common
prefixes of its requests, and sampled tokens one step at a time.
0 1 2 3 4 5 6 7 8 9 10 100 1000
"""


def _corpus() -> list[str]:
    return [_TEXT] * 4


def build_tokenizer(vocab_size: int = 512) -> Any:
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _hf_config(architecture: str, vocab_size: int, eos_id: int, overrides: dict[str, Any]) -> Any:
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        initializer_range=0.1,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
    )
    if architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        common["head_dim"] = 16
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        common["use_sliding_window"] = False
    common.update(_MOE_DEFAULTS.get(architecture, {}))
    common.update(overrides)
    config_cls = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    return config_cls(**common)


def build_tiny_checkpoint(
    path: str | Path,
    architecture: str = "LlamaForCausalLM",
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random ``architecture`` checkpoint with a trained tokenizer to ``path``.

    ``config_overrides`` go to the transformers config (e.g. ``num_hidden_layers=4``,
    ``rope_scaling={...}``, ``tie_word_embeddings=True``).
    """
    import transformers

    if architecture not in ARCHITECTURES + MOE_ARCHITECTURES:
        raise ValueError(f"unknown architecture {architecture!r}; use one of "
                         f"{ARCHITECTURES + MOE_ARCHITECTURES}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = _hf_config(architecture, len(tokenizer), eos_id, config_overrides)
    torch.manual_seed(seed)
    model = getattr(transformers, architecture)(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
