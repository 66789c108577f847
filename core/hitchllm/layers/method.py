"""Linear methods: how a layer stores its weights and multiplies by them.

A layer (``hitchllm.layers.linear``, ``hitchllm.layers.vocab``) knows its shapes and its
tensor-parallel slice; its *linear method* decides which parameters hold the weight (a plain
matrix, or int8 values plus scales, ...) and how ``apply`` computes ``x @ W.T + bias``. The
default is ``UnquantizedLinearMethod``; a quantization plugin supplies others, per layer,
through ``QuantizationMethod.get_linear_method`` (see ``hitchllm_quantization_methods``).

Every parameter a method creates carries, as attributes (``set_weight_attrs``):

- ``weight_loader(param, loaded_weight, shard_id=None)``: the layer's loader, which copies this
  rank's part of a checkpoint tensor into the parameter's slot (``shard_id`` names the slot of
  a stacked layer: ``"q"``/``"k"``/``"v"`` or ``0``/``1`` for gate/up);
- ``output_dim`` / ``input_dim``: which dimension of the parameter runs along the layer's
  output (rows of the weight) and input (columns), or ``None`` when it does not (a per-tensor
  scale). The loader slices and places the tensor along these dimensions, so a per-output-
  channel scale (``output_dim=0``) lands in its q/k/v or gate/up slot like the weight does;
- ``packed_dim`` / ``pack_factor`` (optional): the parameter stores ``pack_factor`` values per
  element along ``packed_dim`` (eight int4 values in an int32). When that is the output
  dimension, the loader counts slot offsets and tensor-parallel slices in packed elements.
  Along the input dimension nothing changes: a row-parallel loader slices by the parameter's
  own (packed, or per-group) size, so ``input_dim`` works for per-group scales too.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

# A slot of a stacked parameter: ``"q"``/``"k"``/``"v"``, ``0``/``1`` (gate/up), or
# ``(expert, "gate" | "up" | "down")`` in a mixture-of-experts layer's stacked expert weights.
ShardId = int | str | tuple[int, str] | None


class WeightLoader(Protocol):
    def __call__(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
    ) -> None: ...


def set_weight_attrs(param: nn.Parameter, **attrs: Any) -> None:
    """Attach loading attributes (``weight_loader``, ``output_dim``, ``input_dim``,
    ``packed_dim``, ``pack_factor``) to ``param``."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}")
        setattr(param, key, value)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` that refuses a shape mismatch (a broadcast would hide a bad
    checkpoint) and a copy between floating-point and integer dtypes."""
    if dst.shape != src.shape:
        raise ValueError(f"shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    # Float to float converts (a bfloat16 checkpoint in a float32 engine); float to integer
    # would silently truncate, so it is a checkpoint that does not fit the method.
    if dst.dtype.is_floating_point != src.dtype.is_floating_point:
        raise ValueError(f"dtype {src.dtype} does not fit {dst.dtype}")
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(
    param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: ShardId = None
) -> None:
    """The loader of a parameter that is neither sliced nor stacked (norm weights, ...)."""
    if shard_id is not None:
        raise ValueError(f"parameter has no stacked slots, got shard {shard_id!r}")
    copy_checked(param.data, loaded_weight)


class LinearMethod(ABC):
    """How a layer holds and applies its weight. Subclass it in a quantization plugin."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        """Register ``layer``'s weight parameters (``layer.register_parameter``), each with
        ``set_weight_attrs(param, weight_loader=weight_loader, output_dim=..., input_dim=...)``.

        ``output_partition_sizes`` are this rank's output rows per stacked slot (one entry for
        an unstacked layer; q, k, v or gate, up otherwise), ``input_size_per_partition`` this
        rank's input columns. The layer's full sizes are ``layer.input_size`` and
        ``layer.output_size``. Extra checkpoint tensors (scales, zero points) are parameters
        too, named as the checkpoint names them after the layer's prefix.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor is loaded: repack, transpose or fold
        scales here. The default does nothing."""
        return

    @abstractmethod
    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``x @ W.T + bias`` for this rank's slice; ``x`` is ``[tokens, input]``. Runs on the
        hot path and inside CUDA graphs: no host synchronization, no Python per token."""


@functools.cache
def onednn_bf16_available() -> bool:
    """Whether this CPU runs bfloat16 GEMMs in hardware through oneDNN (AVX-512-BF16 or
    AMX-BF16, as torch's oneDNN build reports it)."""
    return (torch.backends.mkldnn.is_available()
            and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()))


# The batch size the prepacked layout is chosen for (any batch runs on it).
_PACK_BATCH_HINT = 32
#: Key of ``layer.__dict__`` under which a plugin may attach a CPU kernel for the layer's
#: bias-free bfloat16 calls (see ``UnquantizedLinearMethod``).
CPU_BF16_KERNEL = "_cpu_bf16_kernel"
#: The same for the layer's bias-free float32 calls.
CPU_F32_KERNEL = "_cpu_f32_kernel"


class UnquantizedLinearMethod(LinearMethod):
    """One ``weight`` of shape ``[output, input]`` in the model dtype; ``apply`` is one
    ``F.linear``.

    A bfloat16 weight on a CPU with hardware bf16 (``onednn_bf16_available``) is multiplied
    through a copy prepacked once into oneDNN's blocked layout (made on first use, dropped by
    ``process_weights_after_loading`` so a reload repacks): ``F.linear`` repacks the weight on
    every call, which made a decode step's small GEMMs (1-32 tokens) take 45-70 us instead of
    35-55 us and bf16 slower than float32 below about 8 tokens. The products are the same
    oneDNN kernels', bit for bit. The copy costs the layer's weight memory once more.

    Before that, a kernel a plugin attached as ``layer.__dict__[CPU_BF16_KERNEL]`` is tried for
    bias-free calls: a callable taking ``x`` and returning ``x @ W.T`` equal to ``F.linear``'s
    bit for bit, or None to pass (attention_cpu's AMX kernel for 1-32 rows); likewise
    ``layer.__dict__[CPU_F32_KERNEL]`` for float32 calls (attention_cpu's MKL packed GEMM for
    16-32 rows). The prepacked copy and the kernels are dropped by
    ``process_weights_after_loading``.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.__dict__.pop("_onednn_weight", None)
        layer.__dict__.pop(CPU_BF16_KERNEL, None)
        layer.__dict__.pop(CPU_F32_KERNEL, None)

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        params_dtype: torch.dtype,
        weight_loader: WeightLoader,
    ) -> None:
        weight = nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition,
                        dtype=params_dtype),
            requires_grad=False,
        )
        set_weight_attrs(weight, weight_loader=weight_loader, output_dim=0, input_dim=1)
        layer.register_parameter("weight", weight)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        weight = layer.weight
        # x.is_cuda first: on a GPU the check ends there, once per linear per step.
        if x.is_cuda:
            return F.linear(x, weight, bias)
        if weight.dtype == torch.bfloat16 and x.dtype == torch.bfloat16 \
                and weight.device.type == "cpu" and not torch.is_grad_enabled():
            kernel = layer.__dict__.get(CPU_BF16_KERNEL)
            if kernel is not None and bias is None:
                out = kernel(x)
                if out is not None:
                    return out
            packed = layer.__dict__.get("_onednn_weight")
            if packed is None and onednn_bf16_available():
                packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(),
                                                                 _PACK_BATCH_HINT)
                layer.__dict__["_onednn_weight"] = packed
            if packed is not None:
                return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
        elif bias is None and CPU_F32_KERNEL in layer.__dict__:
            out = layer.__dict__[CPU_F32_KERNEL](x)
            if out is not None:
                return out
        return F.linear(x, weight, bias)


class QuantizationMethod(Protocol):
    """What a quantization plugin's class (``hitchllm_quantization_methods``) provides once
    constructed as ``cls(model_config)``."""

    def get_linear_method(self, layer: nn.Module, prefix: str) -> LinearMethod | None:
        """The linear method for ``layer``, whose parameters load from checkpoint names
        starting with ``prefix`` (e.g. ``"model.layers.0.self_attn.qkv_proj"``), or ``None``
        to leave the layer unquantized."""
        ...
