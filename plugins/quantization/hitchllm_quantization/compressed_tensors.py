"""compressed-tensors checkpoints (``quant_method: "compressed-tensors"``), as llm-compressor
writes them: FP8 W8A8 in the ``float-quantized`` format.

The config names its scheme per group of layers::

    "quantization_config": {
      "quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": true},
        "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                              "dynamic": true}}},
      "ignore": ["lm_head"]}

Supported: 8-bit float weights with a ``tensor`` or ``channel`` ``weight_scale``, and 8-bit
float activations either dynamic (``token``; a dynamic ``tensor`` strategy also runs per
token, which is at least as fine) or static per ``tensor`` (an ``input_scale`` per layer).
Layers run through ``Fp8LinearMethod``. Anything else (int4 ``pack-quantized``, int8, group
or block scales, weight-only fp8) is refused with what was found and what is supported. The
config is parsed here; the ``compressed-tensors`` package is not needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from hitchllm.layers import LinearBase, LinearMethod
from hitchllm_quantization.fp8 import Fp8LinearMethod, WeightStrategy, is_ignored
from hitchllm_quantization.fp8_gemm import check_fp8_device

SUPPORTED = ("FP8 W8A8 in the float-quantized format: weights {num_bits: 8, type: float, "
             "strategy: tensor or channel}, input_activations {num_bits: 8, type: float, "
             "dynamic: true with strategy token, or dynamic: false with strategy tensor}")


@dataclass(frozen=True)
class Fp8Scheme:
    """What a config group asks of its layers."""

    weight_strategy: WeightStrategy
    static_activations: bool


def _describe(group: dict[str, Any], fmt: str | None) -> str:
    def side(args: dict[str, Any] | None) -> str:
        if not args:
            return "none"
        keys = ("num_bits", "type", "strategy", "dynamic", "group_size", "block_structure")
        return ", ".join(f"{k}={args[k]}" for k in keys if args.get(k) is not None)

    return (f"format {fmt!r}, weights ({side(group.get('weights'))}), input_activations "
            f"({side(group.get('input_activations'))})")


def parse_scheme(name: str, group: dict[str, Any], fmt: str | None) -> Fp8Scheme:
    """The FP8 scheme of config group ``name``; ValueError naming anything else."""
    weights = group.get("weights") or {}
    acts = group.get("input_activations")
    fmt = group.get("format") or fmt

    def refuse() -> ValueError:
        return ValueError(f"compressed-tensors config group {name!r} uses "
                          f"{_describe(group, fmt)}, which hitchllm does not run; supported: "
                          f"{SUPPORTED}")

    is_fp8 = weights.get("num_bits") == 8 and weights.get("type") == "float"
    if fmt != "float-quantized" or not is_fp8 or not weights.get("symmetric", True):
        raise refuse()
    if weights.get("strategy") not in ("tensor", "channel") or weights.get("dynamic", False):
        raise refuse()
    if not acts or acts.get("num_bits") != 8 or acts.get("type") != "float":
        raise refuse()
    dynamic = bool(acts.get("dynamic"))
    if (dynamic and acts.get("strategy") not in ("token", "tensor")) or (
        not dynamic and acts.get("strategy") != "tensor"
    ):
        raise refuse()
    if group.get("output_activations"):
        raise refuse()
    targets = group.get("targets") or []
    if targets != ["Linear"]:
        raise ValueError(f"compressed-tensors config group {name!r} targets {targets}; "
                         "hitchllm supports groups that target ['Linear'] (every linear layer)")
    return Fp8Scheme(weights["strategy"], static_activations=not dynamic)


class CompressedTensors:
    """The ``"compressed-tensors"`` quantization method (FP8 ``float-quantized`` only)."""

    def __init__(self, model_config: Any) -> None:
        config = model_config.hf_config.get("quantization_config") or {}
        if config.get("quant_method") != "compressed-tensors":
            raise ValueError("quantization='compressed-tensors' loads checkpoints whose "
                             "quantization_config.quant_method is 'compressed-tensors'; to "
                             "quantize a float checkpoint at load use quantization='fp8'")
        # ``kv_cache_scheme`` (fp8 KV-cache k_scale/v_scale) is validated and served by the
        # KV-cache side of this plugin (fp8_kv); here it only tells a KV-cache-only checkpoint.
        sparsity = (config.get("sparsity_config") or {}).get("format")
        if sparsity not in (None, "dense"):
            raise ValueError(f"compressed-tensors sparsity format {sparsity!r} is not supported; "
                             "hitchllm loads dense FP8 checkpoints")
        groups = config.get("config_groups") or {}
        self.ignore: list[str] = list(config.get("ignore") or [])
        # A checkpoint that quantizes only its KV cache (llm-compressor writes empty
        # config_groups and a kv_cache_scheme) keeps its weights as they are.
        self.scheme: Fp8Scheme | None = None
        if not groups:
            if not config.get("kv_cache_scheme"):
                raise ValueError("compressed-tensors quantization_config has neither "
                                 "config_groups nor a kv_cache_scheme: nothing is quantized; "
                                 "remove quantization_config from config.json to load the "
                                 "checkpoint as float")
            return
        schemes = {parse_scheme(n, g, config.get("format")) for n, g in groups.items()}
        if len(schemes) > 1:
            raise ValueError(f"compressed-tensors config groups {sorted(groups)} ask for "
                             "different schemes for the same layers; hitchllm supports one "
                             "FP8 scheme for all linear layers")
        self.scheme = schemes.pop()
        check_fp8_device(torch.get_default_device())

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if (self.scheme is None or not isinstance(layer, LinearBase)
                or is_ignored(prefix, self.ignore)):
            return None
        return Fp8LinearMethod(prequantized=True,
                               weight_strategy=self.scheme.weight_strategy,
                               static_activations=self.scheme.static_activations)
