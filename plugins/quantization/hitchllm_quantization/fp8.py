"""fp8 weights and activations (W8A8, e4m3): ``quantization="fp8"``.

Two ways in:

- **online**: an ordinary bfloat16/float16/float32 checkpoint with ``quantization="fp8"``. The
  weights load in the model dtype; after loading, every linear layer is quantized to fp8 with
  one float32 scale per output channel (``amax / 448``).
- **pre-quantized**: a checkpoint whose ``quantization_config.quant_method`` is ``"fp8"``: each
  projection's ``weight`` is stored as ``float8_e4m3fn`` next to its ``weight_scale`` (one value
  per tensor, or one per output channel), plus an ``input_scale`` per tensor when
  ``activation_scheme`` is ``"static"``. A fused layer (q/k/v, gate/up) receives one per-tensor
  scale per slot; each is spread over its slot's rows as it loads, so the fused GEMM multiplies
  exactly the stored fp8 values by exactly the stored scales. Static input scales of a fused
  layer become their maximum (one activation quantization feeds all slots).

Activations are quantized per token at run time (``activation_scheme`` ``"dynamic"``, and
always in online mode), or with the static ``input_scale``. The embedding and the LM head stay
in float; ``ignored_layers`` (and compressed-tensors' ``ignore``) leave named layers in float.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

import torch
from torch import nn

from hitchllm.layers import (
    LinearBase,
    LinearMethod,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    UnquantizedLinearMethod,
    WeightLoader,
    set_weight_attrs,
)
from hitchllm_quantization.fp8_gemm import (
    FP8,
    check_fp8_device,
    emulated_fp8_linear,
    fp8_capable,
    quantize_activations,
    quantize_rows,
    scaled_mm_fits,
    scaled_mm_fp8_linear,
)

# "tensor": one weight scale per tensor (per slot of a fused layer); "channel": one per output
# row; None: whichever the checkpoint stores (the "fp8" format does not say).
WeightStrategy = Literal["tensor", "channel"] | None


def _slot_rows(layer: LinearBase, shard_id: Any) -> int:
    """Rows of the checkpoint tensor that loads into slot ``shard_id`` of ``layer`` (the
    whole layer for ``None``)."""
    if shard_id is None:
        return layer.output_size
    if isinstance(layer, QKVParallelLinear):
        heads = layer.total_num_heads if shard_id == "q" else layer.total_num_kv_heads
        return heads * layer.head_size
    if isinstance(layer, MergedColumnParallelLinear):
        return layer.output_sizes[shard_id]
    raise ValueError(f"{type(layer).__name__} has no stacked slot {shard_id!r}")


def _slot_index(layer: LinearBase, shard_id: Any) -> int:
    return "qkv".index(shard_id) if isinstance(layer, QKVParallelLinear) else int(shard_id)


class Fp8LinearMethod(LinearMethod):
    """fp8 weight ``[N, K]`` with float32 ``weight_scale`` ``[N]`` (per output row, however
    the checkpoint stored it); activations quantized per token or by a static
    ``input_scale``. ``prequantized=False`` loads float weights and quantizes them after
    loading."""

    def __init__(
        self, *, prequantized: bool, weight_strategy: WeightStrategy = None,
        static_activations: bool = False,
    ) -> None:
        if static_activations and not prequantized:
            raise ValueError("activation_scheme 'static' needs a pre-quantized fp8 checkpoint "
                             "(its input_scale tensors); quantizing at load, use "
                             "activation_scheme 'dynamic'")
        self.prequantized = prequantized
        self.weight_strategy = weight_strategy
        self.static_activations = static_activations
        self.use_scaled_mm = False

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int,
        output_partition_sizes: list[int], params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if not self.prequantized:
            UnquantizedLinearMethod().create_weights(
                layer, input_size_per_partition, output_partition_sizes, params_dtype,
                weight_loader)
            return
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=FP8),
                              requires_grad=False)
        set_weight_attrs(weight, weight_loader=self._fp8_loader(weight_loader),
                         output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)
        scale = nn.Parameter(torch.empty(rows, dtype=torch.float32), requires_grad=False)
        set_weight_attrs(scale, weight_loader=self._weight_scale_loader(layer, weight_loader),
                         output_dim=0)
        layer.register_parameter("weight_scale", scale)
        if self.static_activations:
            input_scale = nn.Parameter(
                torch.empty(len(output_partition_sizes), dtype=torch.float32),
                requires_grad=False)
            set_weight_attrs(input_scale, weight_loader=self._input_scale_loader(layer))
            layer.register_parameter("input_scale", input_scale)

    @staticmethod
    def _fp8_loader(weight_loader: WeightLoader) -> WeightLoader:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            if loaded.dtype != FP8:
                raise ValueError(
                    f"dtype {loaded.dtype} is not float8_e4m3fn: the checkpoint says it is fp8 "
                    "pre-quantized but stores other weights (to quantize a float checkpoint "
                    "at load, drop its quantization_config and pass quantization='fp8')")
            weight_loader(param, loaded, shard_id)
        return load

    def _weight_scale_loader(self, layer: nn.Module, weight_loader: WeightLoader) -> WeightLoader:
        strategy = self.weight_strategy

        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            rows = _slot_rows(layer, shard_id)  # type: ignore[arg-type]
            per_tensor = loaded.numel() == 1 and loaded.dim() <= 1
            per_channel = tuple(loaded.shape) in ((rows,), (rows, 1))
            if (per_tensor and strategy != "channel") or (per_channel and strategy != "tensor"):
                weight_loader(param, loaded.float().reshape(-1).expand(rows), shard_id)
                return
            wanted = {"tensor": "a per-tensor scale of shape () or (1,)",
                      "channel": f"one per output channel, shape ({rows},) or ({rows}, 1)",
                      None: f"a per-tensor scale of shape () or (1,), or one per output "
                            f"channel, shape ({rows},) or ({rows}, 1)"}[strategy]
            raise ValueError(f"weight_scale has shape {tuple(loaded.shape)}; expected {wanted}")
        return load

    @staticmethod
    def _input_scale_loader(layer: nn.Module) -> WeightLoader:
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: Any = None) -> None:
            if loaded.numel() != 1:
                raise ValueError(f"input_scale has shape {tuple(loaded.shape)}; a static "
                                 "activation scale is one value per tensor")
            with torch.no_grad():
                if shard_id is None:
                    param.fill_(loaded.item())
                else:
                    param[_slot_index(layer, shard_id)] = loaded.item()  # type: ignore[arg-type]
        return load

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        if not self.prequantized:
            values, scale = quantize_rows(layer.weight.data)
            layer.weight = nn.Parameter(values, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
        if self.static_activations:
            layer.input_scale = nn.Parameter(layer.input_scale.data.amax(),
                                             requires_grad=False)
        device = layer.weight.device
        check_fp8_device(device)
        self.use_scaled_mm = fp8_capable(device) and scaled_mm_fits(layer.weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        static = layer.input_scale if self.static_activations else None
        xq, x_scale = quantize_activations(flat, static)
        gemm = scaled_mm_fp8_linear if self.use_scaled_mm else emulated_fp8_linear
        out = gemm(xq, x_scale, layer.weight, layer.weight_scale, x.dtype)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], out.shape[-1])


def is_ignored(prefix: str, ignore: Iterable[str]) -> bool:
    """Whether the layer at ``prefix`` is listed (by its full name, or the checkpoint name of
    one of its fused parts, e.g. ``model.layers.0.self_attn.q_proj``; ``re:`` entries are
    regular expressions matched against the name)."""
    names = {prefix}
    parent, _, leaf = prefix.rpartition(".")
    parts = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    names.update(f"{parent}.{p}" if parent else p for p in parts.get(leaf, ()))
    for entry in ignore:
        if entry.startswith("re:"):
            if any(re.fullmatch(entry[3:], n) for n in names):
                return True
        elif entry in names:
            return True
    return False


class Fp8:
    """The ``"fp8"`` quantization method: online for a float checkpoint, pre-quantized for one
    whose ``quantization_config.quant_method`` is ``"fp8"``."""

    def __init__(self, model_config: Any) -> None:
        config = model_config.hf_config.get("quantization_config") or {}
        method = config.get("quant_method")
        if method not in (None, "fp8"):
            raise ValueError(
                f"the checkpoint is already quantized with {method!r}; quantization='fp8' "
                f"quantizes float checkpoints: leave quantization unset (or pass {method!r})")
        self.prequantized = method == "fp8"
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"quantization_config.activation_scheme {scheme!r} is not "
                             "supported; use 'dynamic' or 'static'")
        if config.get("weight_block_size"):
            raise ValueError("block-wise fp8 weights (quantization_config.weight_block_size) "
                             "are not supported; per-tensor and per-channel scales are")
        self.static_activations = scheme == "static"
        self.ignore: list[str] = list(config.get("ignored_layers") or [])
        check_fp8_device(torch.get_default_device())

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        if not isinstance(layer, LinearBase) or is_ignored(prefix, self.ignore):
            return None
        return Fp8LinearMethod(prequantized=self.prequantized,
                               static_activations=self.static_activations)
