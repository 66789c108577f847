"""Hugging Face transformers as the oracle for generated tokens."""

from __future__ import annotations

import functools

import torch
from transformers import AutoModelForCausalLM


@functools.lru_cache(maxsize=8)
def hf_model(path: str, dtype: torch.dtype = torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def hf_sampling_probs(model, ids: list[int], temperature: float, top_k: int) -> torch.Tensor:
    """The float64 next-token distribution after ``ids`` under ``model`` (a transformers
    model) with ``temperature`` and ``top_k`` applied, as the engine's sampler defines them."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1].double() / temperature
    kth = logits.topk(top_k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf")).softmax(-1)


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
