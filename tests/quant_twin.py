"""Quantized test checkpoints and their dequantized float twins: writing them, and checking
that a quantized model computes what its twin does, layer by layer and as log-probabilities
over the full vocabulary."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from hitchllm import LLM, SamplingParams


def write_checkpoint(source: Path, path: Path, tensors: dict[str, torch.Tensor],
                     quantization_config: dict | None = None) -> str:
    """A copy of checkpoint ``source`` at ``path`` holding ``tensors``, with
    ``quantization_config`` added to its config.json when given."""
    shutil.copytree(source, path, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(path / "model.safetensors"))
    if quantization_config is not None:
        config = json.loads((path / "config.json").read_text())
        config["quantization_config"] = quantization_config
        (path / "config.json").write_text(json.dumps(config))
    return str(path)


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
