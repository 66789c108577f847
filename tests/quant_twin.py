"""Checks that a quantized model computes what its dequantized float twin does: layer by layer
and as log-probabilities over the full vocabulary."""

from __future__ import annotations

import torch

from hitchllm import LLM, SamplingParams


def assert_layers_match(quantized: LLM, reference: LLM, marker: str, tol: float = 1e-5,
                        scale: float = 1.0, generator: torch.Generator | None = None) -> int:
    """Feed every layer of ``quantized`` that has a ``marker`` attribute (``"qweight"``,
    ``"weight_scale"``) and the layer of the same name in ``reference`` the same random
    ``[5, input_size]`` input (times ``scale``); assert the outputs agree within ``tol``.
    Returns how many layers were checked."""
    model = quantized.engine.executor.runner.model
    reference_layers = dict(reference.engine.executor.runner.model.named_modules())
    checked = 0
    for name, layer in model.named_modules():
        if hasattr(layer, marker):
            x = torch.randn(5, layer.input_size, generator=generator,
                            device=quantized.engine.device) * scale
            with torch.no_grad():
                torch.testing.assert_close(layer(x), reference_layers[name](x),
                                           rtol=tol, atol=tol)
            checked += 1
    return checked


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """Log-softmax over the full vocabulary at every prompt position after the first."""
    vocab = llm.engine.executor.runner.model.config.vocab_size
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=1, prompt_logprobs=vocab), use_tqdm=False)
    return torch.tensor([[entry[i].logprob for i in range(vocab)]
                         for out in outs for entry in out.prompt_logprobs[1:]])
