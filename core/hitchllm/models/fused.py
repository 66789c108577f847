"""The model's elementwise work (norms, residual adds, rotary, the gated activation) as plain
PyTorch functions that run as the engine's own Triton kernels on CUDA, or as a plugin's
kernels on other devices.

Written op by op, RMSNorm alone is seven kernels and rotary a dozen; at decode batch sizes
each kernel is a few microseconds of fixed cost, which for a 28-layer model adds up to more
than the attention itself. On CUDA each function below runs as one Triton kernel of the same
name (``hitchllm.models.elementwise_kernels`` for the norms and the activation,
``hitchllm.models.rotary_kernel`` for rotary; compiled by ``torch.compile``, rotary took four
kernels and several times as long, and loading compiled functions (Dynamo, Inductor) cost
every engine's start-up seconds). Arguments those kernels do not take (float16, a strided last
dimension, more than two dimensions for the norms and the activation, rows wider than 16,384
for the norms, tensors that need gradients) run the function compiled with ``torch.compile``
(dynamic sizes) instead.
Elsewhere, or with fusion turned off (``EngineConfig.enable_fusion``), the same code runs
eagerly, unless a plugin has registered a kernel for the function on the argument's device type
(``register_device_kernels``: attention_cpu supplies C versions for the CPU). Each function
keeps the reference implementation's roundings (residual sums and normalized values are
rounded to the model dtype where Hugging Face transformers rounds them).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

_F = TypeVar("_F", bound=Callable[..., Any])

_fusion_enabled = True
# (device type, function name) -> a plugin's kernel (see register_device_kernels).
_device_kernels: dict[tuple[str, str], Callable[..., Any]] = {}


def set_fusion(enabled: bool) -> None:
    """Turn the fused kernels of the functions below (the engine's own on CUDA, else compiled;
    plugins' device kernels elsewhere) on or off, for every model in the process."""
    global _fusion_enabled
    _fusion_enabled = enabled


def fusion_enabled() -> bool:
    """Whether ``set_fusion`` left fusion on (the default)."""
    return _fusion_enabled


def register_device_kernels(device_type: str, kernels: dict[str, Callable[..., Any]]) -> None:
    """Run ``kernels[name]`` in place of the function ``name`` below (``rms_norm``,
    ``add_rms_norm``, ``rotary``, ``qk_norm_rotary``, ``silu_and_mul``) when its first
    argument is a tensor on ``device_type`` and fusion is on (``set_fusion``), for every model
    in the process; registering a name again replaces its kernel.

    A kernel takes the function's arguments and returns its result, or None for arguments it
    does not handle (a dtype, a layout), which then run as written here. It must return what
    the function computes with the same roundings, and where it cannot match PyTorch's result
    bit for bit (a reduction in another order) it should handle only dtypes where that is
    tolerated (float32 greedy outputs are compared bit for bit with transformers). Not for
    "cuda", where the functions run as hitchllm's own Triton kernels."""
    if device_type == "cuda":
        raise ValueError("the fused functions run as hitchllm's own Triton kernels on CUDA; "
                         "register device kernels for another device type")
    unknown = set(kernels) - set(FUNCTIONS)
    if unknown:
        raise ValueError(f"no fused function named {', '.join(sorted(unknown))}; the "
                         f"functions are {', '.join(FUNCTIONS)}")
    for name, kernel in kernels.items():
        _device_kernels[(device_type, name)] = kernel


def unregister_device_kernels(device_type: str) -> None:
    """Forget every kernel registered for ``device_type``."""
    for key in [k for k in _device_kernels if k[0] == device_type]:
        del _device_kernels[key]


def _recompile_limit_error() -> type[Exception]:
    # Imported late: torch._dynamo takes a second to import, and only compiled calls need it.
    from torch._dynamo.exc import FailOnRecompileLimitHit

    return FailOnRecompileLimitHit


def _signature(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """What makes dynamo compile anew (besides sizes, which are dynamic): dtypes, ranks and
    devices of the tensor arguments, and the grad mode."""
    tensors = tuple((a.dtype, a.dim(), a.device.type) for a in args
                    if isinstance(a, torch.Tensor))
    return tensors, torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def _fused(
    fn: _F, applies: Callable[[torch.Tensor], bool],
    load_kernel: Callable[[], Callable[..., Any]] | None = None,
) -> _F:
    """Run ``fn`` compiled when ``applies(first argument)`` and fusion is on; with
    ``load_kernel``, the kernel it returns (loaded on the first such call) first, compiled
    where that kernel returns None.

    Dynamo keeps a bounded number of compilations per function (``recompile_limit``); a
    process that builds many engines (tests, notebooks, a server with several models) can pass
    it with new dtypes or grad modes. Such a call, and every later one of the same kind, runs
    eagerly (the same arithmetic), with one warning; the kinds compiled before stay compiled.
    """
    compiled: Callable[..., Any] | None = None
    loaded: Callable[..., Any] | None = None
    eager_kinds: set[tuple[Any, ...]] = set()

    def run(*args: Any) -> Any:
        nonlocal compiled, loaded
        if not (_fusion_enabled and applies(args[0])):
            if _fusion_enabled and _device_kernels:
                device_kernel = _device_kernels.get((args[0].device.type, fn.__name__))
                if device_kernel is not None:
                    out = device_kernel(*args)
                    if out is not None:
                        return out
            return fn(*args)
        if load_kernel is not None:
            if loaded is None:
                loaded = load_kernel()
            out = loaded(*args)
            if out is not None:
                return out
        if eager_kinds and _signature(args) in eager_kinds:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(*args)
        except _recompile_limit_error():
            if not eager_kinds:
                logger.warning("%s: torch.compile's recompile limit reached (many engines in "
                               "one process); new argument kinds run without fusion",
                               fn.__name__)
            eager_kinds.add(_signature(args))
            return fn(*args)

    run.__doc__ = fn.__doc__
    run.__name__ = fn.__name__
    run.__wrapped__ = fn  # type: ignore[attr-defined]
    return run  # type: ignore[return-value]


def _triton_on_cuda(module: str) -> Callable[[_F], _F]:
    """Run the function as the Triton kernel of its name in ``hitchllm.models.<module>``
    (else compiled, where that kernel returns None) when its first argument is a CUDA tensor
    and fusion is on."""

    def wrap(fn: _F) -> _F:
        def load_kernel() -> Callable[..., Any]:
            # Imported on first use: Triton is optional for the core.
            return getattr(importlib.import_module(f"hitchllm.models.{module}"), fn.__name__)

        return _fused(fn, lambda x: x.is_cuda, load_kernel)

    return wrap


def _normalize(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@_triton_on_cuda("elementwise_kernels")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension, statistics in float32."""
    return _normalize(x, weight, eps)


@_triton_on_cuda("elementwise_kernels")
def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual), x + residual)``: a decoder layer's residual add and the
    next norm in one pass."""
    total = x + residual
    return _normalize(total, weight, eps), total


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x * [cos, cos] + [-x2, x1] * [sin, sin] for x = [x1, x2], half by half: the same
    # products and sums (so the same roundings in any dtype) without building the rotated copy
    # or the doubled tables.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    # The tables are float32; rounded to the model dtype once for queries and keys alike.
    c = cos[positions].to(q.dtype).unsqueeze(1)
    s = sin[positions].to(q.dtype).unsqueeze(1)
    return _rotate(q, c, s), _rotate(k, c, s)


@_triton_on_cuda("rotary_kernel")
def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half rotary embedding of ``q`` [T, heads, d] and ``k`` [T, kv_heads, d] at
    ``positions`` [T], from float32 ``cos``/``sin`` tables [max_position, d / 2]."""
    return _apply_rotary(positions, q, k, cos, sin)


@_triton_on_cuda("rotary_kernel")
def qk_norm_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
    k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3's per-head RMSNorm of queries and keys, then rotary, in one pass."""
    return _apply_rotary(positions, _normalize(q, q_weight, eps), _normalize(k, k_weight, eps),
                         cos, sin)


@_triton_on_cuda("elementwise_kernels")
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dimension."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


#: The functions a plugin can supply device kernels for (``register_device_kernels``).
FUNCTIONS = ("rms_norm", "add_rms_norm", "rotary", "qk_norm_rotary", "silu_and_mul")
