"""Building a model from a checkpoint directory: architecture lookup, construction, weights."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from hitchllm.config import ModelConfig
from hitchllm.layers import QuantizationMethod, process_weights_after_loading
from hitchllm.plugins import PluginRegistry


def model_architectures(registry: PluginRegistry) -> dict[str, type[nn.Module]]:
    """Architecture name -> model class, merged over plugins (last registered wins)."""
    merged: dict[str, type[nn.Module]] = {}
    # pluggy returns results last-registered first; apply in registration order.
    for result in reversed(registry.hook.hitchllm_model_architectures()):
        merged.update(result or {})
    return merged


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's weight files: ``*.safetensors`` (via the shard index when there is
    one), else PyTorch's ``pytorch_model*.bin`` (likewise)."""
    for index_name, pattern in (("model.safetensors.index.json", "*.safetensors"),
                                ("pytorch_model.bin.index.json", "pytorch_model*.bin")):
        index = path / index_name
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [path / name for name in sorted(set(weight_map.values()))]
        files = sorted(path.glob(pattern))
        if files:
            return files
    raise FileNotFoundError(
        f"no weights in {path}: hitchllm loads Hugging Face checkpoints with *.safetensors "
        "or pytorch_model*.bin files"
    )


def iterate_weights(
    path: Path, wanted: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the checkpoint (those whose name ``wanted`` accepts, when given), file
    by file, loaded on the CPU; a tensor not wanted is not read from a safetensors file.
    ``.bin`` files are read with ``torch.load(weights_only=True)``: tensors only, no pickled
    code runs."""
    for file in weight_files(path):
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    if wanted is None or wanted(name):
                        yield name, f.get_tensor(name)
        else:
            state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            yield from ((n, t) for n, t in state.items() if wanted is None or wanted(n))


# Methods of the hitchllm-quantization plugin, named when it is not installed.
_PLUGIN_METHODS = ("fp8", "compressed-tensors", "awq")


def quantization_method(
    config: ModelConfig, registry: PluginRegistry, requested: str | None
) -> Callable[[ModelConfig], QuantizationMethod] | None:
    """The quantization class for ``requested`` (or the checkpoint's own ``quant_method``)."""
    name = requested or (config.hf_config.get("quantization_config") or {}).get("quant_method")
    if name is None:
        return None
    methods: dict[str, Callable[[ModelConfig], QuantizationMethod]] = {}
    for result in reversed(registry.hook.hitchllm_quantization_methods()):
        methods.update(result or {})
    if name not in methods:
        hint = (f"; {name!r} comes with the hitchllm-quantization plugin: pip install "
                "hitchllm-quantization (from the repository: pip install -e plugins/quantization)"
                if name in _PLUGIN_METHODS else "")
        raise ValueError(
            f"quantization method {name!r} is not provided by any installed plugin; installed: "
            f"{', '.join(sorted(methods)) or 'none'} (quantization comes from a plugin that "
            f"implements hitchllm_quantization_methods){hint}"
        )
    return methods[name]


def load_model(
    config: ModelConfig,
    registry: PluginRegistry,
    device: torch.device,
    dtype: torch.dtype,
    quantization: str | None = None,
) -> nn.Module:
    """Construct the architecture's model on ``device`` in ``dtype`` and load its weights.

    A quantization method (``requested``, or the checkpoint's ``quant_method``) is constructed
    as ``cls(model_config)`` and passed to the model as ``quant_config``: each linear layer
    asks it for its linear method at construction, and the method's parameters (scales, ...)
    load through the same weight loaders. Every linear method then gets its
    ``process_weights_after_loading`` call. A model with a ``wants_checkpoint_tensor(name)``
    method (a pipeline stage) is handed only the tensors it accepts."""
    archs = model_architectures(registry)
    cls = archs.get(config.architecture)
    if cls is None:
        raise ValueError(
            f"architecture {config.architecture!r} is not supported by any installed plugin; "
            f"supported: {', '.join(sorted(archs))}"
        )
    quant_cls = quantization_method(config, registry, quantization)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            quant_config = quant_cls(config) if quant_cls is not None else None
            model = cls(config, quant_config=quant_config)
    finally:
        torch.set_default_dtype(previous)
    # A model that holds part of the checkpoint (one pipeline stage) says which tensors.
    model.load_weights(iterate_weights(config.path,
                                       getattr(model, "wants_checkpoint_tensor", None)))
    process_weights_after_loading(model)
    return model.eval()
