"""Hugging Face transformers as the oracle for generated tokens."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def hf_model(path: str, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """Greedy continuations from ``generate``. EOS is suppressed for all ``max_new_tokens``
    (``min_new_tokens``), matching hitchllm's ``min_tokens == max_tokens``."""
    model = hf_model(path, dtype)
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
        )
        outs.append(gen[0, len(prompt):].tolist())
    return outs
