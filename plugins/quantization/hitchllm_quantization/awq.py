"""int4 weight-only quantization for AWQ checkpoints (``quant_method == "awq"``, GEMM packing).

``AWQ(model_config)`` reads the checkpoint's ``quantization_config`` (AutoAWQ's keys: ``bits``
or ``w_bit``, ``group_size`` or ``q_group_size``, ``zero_point``, ``version``,
``modules_to_not_convert``) and gives each linear layer an ``AWQLinearMethod``: parameters
``qweight``, ``qzeros`` and ``scales`` laid out as ``hitchllm_quantization.awq_packing``
describes, loaded through the layer's weight loaders (the output dimension is packed 8 to an
int32: ``packed_dim``/``pack_factor``). On CUDA the loaded int4 values are re-laid out once
for the Triton dequantize-and-multiply kernels (``awq_packing.pack_along_k``), which ``apply``
runs; elsewhere ``apply`` dequantizes to a float weight for one ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from hitchllm.layers import LinearBase, LinearMethod, WeightLoader, set_weight_attrs
from hitchllm_quantization.awq_packing import PACK_FACTOR, dequantize, pack_along_k

if TYPE_CHECKING:
    from hitchllm.config import ModelConfig

# Stacked layers and the checkpoint modules they fuse (for modules_to_not_convert).
_STACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _field(config: dict[str, Any], names: tuple[str, ...], default: Any) -> Any:
    for name in names:
        if name in config:
            return config[name]
    return default


class AWQConfig:
    """The supported subset of an AWQ ``quantization_config``: 4 bits, zero points, GEMM
    packing, any group size that divides each layer's input."""

    def __init__(self, config: dict[str, Any]) -> None:
        if config.get("quant_method") != "awq":
            raise ValueError(
                f"quantization='awq' loads AWQ checkpoints, whose config.json has "
                f"quantization_config.quant_method 'awq'; this one has "
                f"{config.get('quant_method')!r} (quantize it with AutoAWQ or "
                "scripts/quantize_awq_rtn.py)"
            )
        self.bits = _field(config, ("bits", "w_bit"), 4)
        if self.bits != 4:
            raise ValueError(f"AWQ quantization_config.bits is {self.bits}; only 4 is supported")
        self.group_size = _field(config, ("group_size", "q_group_size"), 128)
        if not isinstance(self.group_size, int) or self.group_size <= 0:
            raise ValueError(f"AWQ quantization_config.group_size is {self.group_size!r}; use a "
                             "positive group size (128, 64, 32, ...)")
        if _field(config, ("zero_point",), True) is not True:
            raise ValueError("AWQ quantization_config.zero_point is false; only zero_point true "
                             "(asymmetric int4 with qzeros) is supported")
        version = str(_field(config, ("version",), "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"AWQ quantization_config.version is {version!r}; only 'gemm' "
                             "packing is supported (not gemv, gemv_fast, marlin or exllama)")
        self.modules_to_not_convert: list[str] = list(config.get("modules_to_not_convert") or [])

    def is_converted(self, prefix: str) -> bool:
        """Whether the layer at ``prefix`` is quantized (not named by ``modules_to_not_convert``);
        a stacked layer must be all quantized or all not."""
        parent, _, leaf = prefix.rpartition(".")
        names = [f"{parent}.{part}" for part in _STACKED.get(leaf, (leaf,))]
        skipped = [any(m in name for m in self.modules_to_not_convert) for name in names]
        if any(skipped) and not all(skipped):
            raise ValueError(
                f"modules_to_not_convert leaves some of {names} in float but not all; they are "
                f"fused into {prefix}, which is either quantized or not"
            )
        return not any(skipped)


class AWQ:
    """The ``"awq"`` quantization method (``hitchllm_quantization_methods``)."""

    def __init__(self, model_config: ModelConfig) -> None:
        self.config = AWQConfig(model_config.hf_config.get("quantization_config") or {})

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """AWQ for the linear layers; the LM head and ``modules_to_not_convert`` stay float."""
        if isinstance(layer, LinearBase) and self.config.is_converted(prefix):
            return AWQLinearMethod(self.config.group_size, prefix)
        return None


class AWQLinearMethod(LinearMethod):
    """``qweight``/``qzeros``/``scales`` in AWQ's GEMM packing; ``apply`` dequantizes."""

    def __init__(self, group_size: int, prefix: str) -> None:
        self.group_size = group_size
        self.prefix = prefix
        self._gemm: Callable[..., torch.Tensor] | None = None  # the Triton kernel, on CUDA

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        if input_size_per_partition % self.group_size:
            raise ValueError(
                f"AWQ group_size {self.group_size} does not divide the input size "
                f"{input_size_per_partition} of {self.prefix} (per tensor-parallel rank); the "
                "checkpoint's group size must divide every layer's input"
            )
        for size in output_partition_sizes:
            if size % PACK_FACTOR:
                raise ValueError(f"{self.prefix} has an output part of {size} rows; AWQ packs 8 "
                                 "rows per int32, so each part must be a multiple of 8")
        rows = sum(output_partition_sizes)
        groups = input_size_per_partition // self.group_size
        packed = {"packed_dim": 1, "pack_factor": PACK_FACTOR}
        for name, shape, dtype, attrs in (
            ("qweight", (input_size_per_partition, rows // PACK_FACTOR), torch.int32, packed),
            ("qzeros", (groups, rows // PACK_FACTOR), torch.int32, packed),
            ("scales", (groups, rows), torch.float16, {}),
        ):
            param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_weight_attrs(param, weight_loader=weight_loader, output_dim=1, input_dim=0,
                             **attrs)
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """On CUDA, import the Triton kernel now (not on the hot path), or say what to
        install, and re-lay the int4 values out for it (``pack_along_k``: the same bytes,
        packed along the input dimension; the zero points unpacked to one byte each)."""
        if not layer.qweight.is_cuda:
            return
        try:
            from hitchllm_quantization.awq_triton import awq_gemm
        except ImportError as err:
            raise ImportError(
                f"AWQ on CUDA runs a Triton kernel, and Triton does not import ({err}): "
                "pip install 'hitchllm-quantization[kernels]'"
            ) from err
        if self.group_size % PACK_FACTOR:
            raise ValueError(f"AWQ group_size {self.group_size}: the CUDA kernels need a "
                             "multiple of 8 (32, 64, 128, ...)")
        self._gemm = awq_gemm
        words, zeros = pack_along_k(layer.qweight.data, layer.qzeros.data)
        layer.qweight = nn.Parameter(words, requires_grad=False)
        layer.qzeros = nn.Parameter(zeros, requires_grad=False)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        if x.is_cuda and self._gemm is not None:
            flat = x.reshape(-1, x.shape[-1])
            out = self._gemm(flat, layer.qweight, layer.qzeros, layer.scales, self.group_size)
            out = out.reshape(*x.shape[:-1], out.shape[-1])
            return out if bias is None else out + bias
        weight = dequantize(layer.qweight, layer.qzeros, layer.scales, self.group_size, x.dtype)
        return F.linear(x, weight, bias)
