"""bfloat16 linear layers of 1-32 rows (decode steps) through amx_linear.c on CPUs with AMX.

At decode sizes oneDNN's AMX GEMM (``UnquantizedLinearMethod``'s prepacked path) pays 13-27 us
of set-up per call whatever the work (the bundled model's layers: 22-40 us a call, 50-85 us
inside the engine); the C kernel here configures the tiles and streams a copy of the weight
prepacked once into the tile layout. Its products and float32 sums are TDPBF16PS's in the
same order as oneDNN's, so the result equals ``F.linear``'s bit for bit (tests compare).

``install(model)`` (called by the plugin once a bfloat16 CPU model is loaded, with fusion on)
gives every unquantized linear layer whose shape the kernel takes (inputs a multiple of 32,
outputs of 16) an ``AmxLinearMethod``; everything else (more rows, a bias, float32, autograd)
runs as before. The copy costs the layer's weight memory once more.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from hitchllm.layers import LinearBase, ParallelLMHead, UnquantizedLinearMethod
from hitchllm_attention_cpu.compiler import load_amx_linear

#: The most rows (tokens) a call takes; more go to oneDNN.
MAX_ROWS = 32


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [n, k] bfloat16 in amx_linear.c's tile layout [n/16, k/32, 16, 16, 2]."""
    n, k = weight.shape
    return (weight.detach().reshape(n // 16, 16, k // 32, 16, 2).permute(0, 2, 3, 1, 4)
            .contiguous())


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel takes a layer with this weight."""
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0)


class AmxLinearMethod(UnquantizedLinearMethod):
    """``UnquantizedLinearMethod`` whose calls of 1-``MAX_ROWS`` rows without a bias run the
    AMX kernel on a prepacked copy of the weight (made on first use, dropped by
    ``process_weights_after_loading`` so a reload repacks)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        layer.__dict__.pop("_amx_weight", None)

    def apply(
        self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        # Runs for every linear of every decode step: checks only what can vary per call.
        packed = layer.__dict__.get("_amx_weight")
        if packed is None and takes(layer.weight):
            packed = layer.__dict__["_amx_weight"] = pack_weight(layer.weight)
        if (packed is not None and bias is None and x.dtype == torch.bfloat16
                and x.dim() == 2 and 1 <= x.shape[0] <= MAX_ROWS and x.stride(1) == 1
                and x.shape[1] == packed.shape[1] * 32 and not x.is_cuda
                and not (torch.is_grad_enabled() and (x.requires_grad
                                                      or layer.weight.requires_grad))):
            n = packed.shape[0] * 16
            out = torch.empty(x.shape[0], n, dtype=torch.bfloat16)
            if _kernel()(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], packed.data_ptr(),
                         n, out.data_ptr(), torch.get_num_threads()) == 0:
                return out
        return super().apply(layer, x, bias)


def _kernel() -> Callable[..., int]:
    return load_amx_linear().functions["hitch_amx_linear"]


def available() -> bool:
    """Whether the kernel was built for AMX and Linux granted the tile state."""
    return load_amx_linear().functions["hitch_amx_init"]() == 0


def install(model: nn.Module) -> int:
    """Give every unquantized bfloat16 linear layer (and LM head) of ``model`` the kernel takes an
    ``AmxLinearMethod`` (weights packed now); returns how many layers. Nothing when the kernel
    is unavailable (no AMX, or a compiler that does not target it)."""
    if not available():
        return 0
    count = 0
    for module in model.modules():
        if (isinstance(module, (LinearBase, ParallelLMHead)) and type(module.linear_method)
                is UnquantizedLinearMethod and takes(module.weight)):
            module.linear_method = AmxLinearMethod()
            module.__dict__["_amx_weight"] = pack_weight(module.weight)
            count += 1
    return count
