"""PEFT as the oracle for LoRA: random adapters written by PEFT, and PeftModel's greedy
tokens and log-probabilities."""

from __future__ import annotations

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM


def write_adapter(base: str, out: Path, r: int, targets: list[str], alpha: float | None = None,
                  seed: int = 0, **config) -> str:
    """A PEFT adapter of rank ``r`` on ``targets`` with random A and B (both nonzero), saved
    to ``out``; returns its directory."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base)
    lora = LoraConfig(r=r, lora_alpha=alpha if alpha is not None else 2 * r,
                      target_modules=targets, init_lora_weights=False, **config)
    get_peft_model(model, lora).save_pretrained(out)
    return str(out)


def peft_model(base: str, adapter: str | None):
    """The base model, with ``adapter`` applied by PEFT when given."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return model.eval()


def peft_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation, EOS suppressed (hitchllm's ``min_tokens == max_tokens``)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             do_sample=False, max_new_tokens=max_new_tokens,
                             min_new_tokens=max_new_tokens)
    return gen[0, len(prompt):].tolist()


def peft_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """``[len(output), vocab]`` float64 log-probabilities of each output position."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    return logits[len(prompt) - 1 : len(prompt) + len(output) - 1].log_softmax(-1)
