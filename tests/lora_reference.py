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


def assert_outputs_match_peft(base: str, paths: dict, names: list, prompts: list[list[int]],
                              outs: list, max_new_tokens: int, atol: float = 2e-4) -> None:
    """Each output (its request's adapter ``names[i]``, None for the base model) has PEFT's
    greedy tokens and, for every reported token, PEFT's logprob within ``atol``; and each
    adapter's tokens differ from the base model's (so the comparison can fail)."""
    import pytest

    base_model = peft_model(base, None)
    oracles = {n: peft_model(base, p) for n, p in paths.items()}
    for name, prompt, out in zip(names, prompts, outs, strict=True):
        model = base_model if name is None else oracles[name]
        tokens = out.outputs[0].token_ids
        assert tokens == peft_greedy(model, prompt, max_new_tokens), name
        expected = peft_logprobs(model, prompt, tokens)
        for step, (token, top) in enumerate(zip(tokens, out.outputs[0].logprobs)):
            for token_id, logprob in top.items():
                assert logprob.logprob == pytest.approx(expected[step, token_id].item(),
                                                        abs=atol), (name, step)
            assert token in top
        if name is not None:
            assert tokens != peft_greedy(base_model, prompt, max_new_tokens), name
