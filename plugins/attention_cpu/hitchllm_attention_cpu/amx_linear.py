"""bfloat16 linear layers of 1-32 rows (decode steps) through amx_linear.c on CPUs with AMX.

At decode sizes oneDNN's AMX GEMM (``UnquantizedLinearMethod``'s prepacked path) pays 13-27 us
of set-up per call whatever the work (the bundled model's layers: 22-40 us a call, 50-85 us
inside the engine); the C kernel here configures the tiles and streams a copy of the weight
prepacked once into the tile layout. Its products and float32 sums are TDPBF16PS's in the
same order as oneDNN's, so the result equals ``F.linear``'s bit for bit (tests compare).

``install(model)`` (called by the plugin once a bfloat16 CPU model is loaded, with fusion on)
attaches an ``AmxKernel`` to every unquantized linear layer (and LM head) whose shape the kernel
takes (inputs a multiple of 32, outputs of 16), where ``UnquantizedLinearMethod`` tries it
first (``hitchllm.layers.CPU_BF16_KERNEL``); the layer's linear method stays what it
was. Other calls (more rows, a bias, float32, autograd) run as before, and so does a layer
whose weights are reloaded (``process_weights_after_loading`` drops the kernel). The copy costs
the layer's weight memory once more.
"""

from __future__ import annotations

import torch
from torch import nn

from hitchllm.layers import (
    CPU_BF16_KERNEL,
    LinearBase,
    ParallelLMHead,
    UnquantizedLinearMethod,
)
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


class AmxKernel:
    """``x @ W.T`` for ``x`` of 1-``MAX_ROWS`` bfloat16 rows (row stride free, columns
    contiguous), on a copy of ``W`` packed at construction; None for any other ``x``."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.packed = pack_weight(weight)
        self.n, self.k = weight.shape
        self.function = load_amx_linear().functions["hitch_amx_linear"]

    def __call__(self, x: torch.Tensor) -> torch.Tensor | None:
        # Runs for every linear of every decode step: checks only what can vary per call.
        if (x.dtype != torch.bfloat16 or x.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS
                or x.stride(1) != 1 or x.shape[1] != self.k or x.requires_grad):
            return None
        out = torch.empty(x.shape[0], self.n, dtype=torch.bfloat16)
        if self.function(x.data_ptr(), x.stride(0), x.shape[0], self.k, self.packed.data_ptr(),
                         self.n, out.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return out


def available() -> bool:
    """Whether the kernel was built for AMX and Linux granted the tile state."""
    return load_amx_linear().functions["hitch_amx_init"]() == 0


def install(model: nn.Module) -> int:
    """Attach an ``AmxKernel`` to every unquantized bfloat16 linear layer (and LM head) of
    ``model`` the kernel takes; returns how many layers. Nothing when the kernel is unavailable
    (no AMX, or a compiler that does not target it)."""
    if not available():
        return 0
    count = 0
    for module in unquantized_linears(model):
        if takes(module.weight):
            module.__dict__[CPU_BF16_KERNEL] = AmxKernel(module.weight)
            count += 1
    return count


def unquantized_linears(model: nn.Module) -> list[nn.Module]:
    """``model``'s linear layers and LM heads whose weights are plain (unquantized): the layers
    a CPU GEMM kernel may serve (this one for bfloat16, ``mkl_linear``'s for float32)."""
    return [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))
            and type(m.linear_method) is UnquantizedLinearMethod]
