"""A whole Llama-family decoder layer of a decode step in one C call (decode_layer.c), in
bfloat16 and float32.

Through the modules, a decode step of the bundled model (8 layers, up to 32 rows) spent more
time in Python than in its kernels: each layer makes about 20 module calls, and each of its ten
kernels sits behind a chain of checks (``UnquantizedLinearMethod``, ``fused``'s dispatch, the
kernel's own), output allocations, torch operators for the conversions around the attention
kernel, and a ctypes call. decode_layer.c calls the same kernels (RMSNorm, the q/k/v
projection, rotary, the KV write, CPU_ATTN's kernel, the o projection, add + RMSNorm, gate/up,
SiLU-and-mul, down) with the same inputs in the same order, through pointers to their
functions, so its result equals the modules' bit for bit; what it leaves out is the Python
between them. The linears are the AMX kernel's in bfloat16 (amx_linear.py) and MKL's in
float32 (mkl_linear.py's packed copy for 16-32 rows, else ``sgemm_`` as ``F.linear`` calls it;
both in libtorch); float32 needs the fused kernels' float32 paths, which equal PyTorch's where
``fused.float32_exact()`` says so. The layer's structure is checked once, at ``install``
(``takes``); a call checks what can change from step to step.

It takes steps of 1-``MAX_ROWS`` tokens whose every request goes through CPU_ATTN's
kernel, with a KV cache in the model dtype: decodes, and short prompt chunks too (up to
``KERNEL_MAX_QUERY_LEN`` = 16 new tokens a request; any length under a logits soft-cap), which
the kernel attends causally exactly as the modules do. Anything else (longer prompts, fp8
caches, more tokens, a layer whose linears were reloaded or given another linear method, such
as LoRA's) returns None, and the layer runs its modules. Layers sharded by tensor parallelism
are never taken: their o/down projections sum across ranks (an all-reduce the C call does not
make). Attached by ``install`` as ``layer.__dict__[LAYER_KERNEL]``, which
``PreNormDecoderLayer.forward`` tries first (see its contract there).
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import nn

from hitchllm.attention import get_forward_context
from hitchllm.layers import CPU_BF16_KERNEL, CPU_F32_KERNEL, UnquantizedLinearMethod
from hitchllm.models.llama import LAYER_KERNEL, LlamaAttention, LlamaDecoderLayer, LlamaMLP
from hitchllm_attention_cpu import amx_linear, fused, mkl_linear
from hitchllm_attention_cpu.amx_linear import AmxKernel
from hitchllm_attention_cpu.backend import CpuAttentionImpl, CpuAttentionMetadata
from hitchllm_attention_cpu.compiler import (
    load_amx_linear,
    load_decode_layer,
    load_fused_ops,
    load_kernel,
)
from hitchllm_attention_cpu.mkl_linear import MklPackedLinear

_P, _I, _F, _D = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_double


class _LayerParams(ctypes.Structure):
    """decode_layer.c's ``layer_params``."""

    _fields_ = [
        ("dtype", ctypes.c_int),
        ("rms_norm", _P), ("amx_linear", _P), ("sgemm", _P), ("sgemm_compute", _P),
        ("rotary", _P), ("write_kv", _P),
        ("silu_and_mul", _P), ("attention", _P), ("attention_claim", _P),
        ("input_norm", _P), ("post_norm", _P), ("q_norm", _P), ("k_norm", _P),
        ("input_eps", _F), ("post_eps", _F), ("qk_eps", _F),
        ("packed", _P * 4), ("weight", _P * 4), ("min_packed_rows", _I),
        ("hidden", _I), ("heads", _I), ("kv_heads", _I), ("head_size", _I),
        ("intermediate", _I),
        ("cos", _P), ("sin", _P), ("max_position", _I),
        ("scale", _D), ("softcap", _D), ("window", _I),
    ]


class _StepParams(ctypes.Structure):
    """decode_layer.c's ``step_params``."""

    _fields_ = [
        ("positions", _P), ("slots", _P), ("q_start", _P), ("q_len", _P),
        ("context_len", _P), ("block_table", _P), ("bt_stride", _I), ("num_reqs", _I),
    ]


#: The most rows a call takes (decode_layer.c's PACKED_ROWS; the AMX kernel's limit too).
MAX_ROWS = min(amx_linear.MAX_ROWS, mkl_linear.PACKED_ROWS)

# decode_layer.c's status codes.
_BAD_POSITION, _BAD_SLOT, _NO_MEMORY, _NO_EXP = 1, 2, 3, 5
# decode_layer.c's dtype codes, and where each dtype's linear kernels hang on a layer.
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1}
_LINEAR_KERNEL = {torch.float32: CPU_F32_KERNEL, torch.bfloat16: CPU_BF16_KERNEL}


def _address(function: ctypes._CFuncPtr) -> int | None:
    return ctypes.cast(function, ctypes.c_void_p).value


def _step_params(metadata: CpuAttentionMetadata, positions: torch.Tensor) -> _StepParams:
    """The step's parameters, built by each layer's call: about 1 us, under 0.2% of a step
    (sharing them between a step's layers saved no measurable time)."""
    requests = metadata.kernel
    assert requests is not None  # checked by the caller
    return _StepParams(
        positions.data_ptr(), metadata.slot_mapping.data_ptr(), requests.query_start.data_ptr(),
        requests.query_len.data_ptr(), requests.context_len.data_ptr(),
        requests.block_table.data_ptr(), requests.block_table.stride(0),
        requests.query_len.shape[0])


class DecodeLayerKernel:
    """``layer(positions, hidden, residual)`` for a short step, or None (see the module's
    docstring). It holds its layer weakly: the layer holds it (``LAYER_KERNEL``), and a strong
    reference back would keep both alive until the garbage collector's next cycle pass."""

    def __init__(self, layer: LlamaDecoderLayer) -> None:
        attention: LlamaAttention = layer.self_attn  # type: ignore[assignment]
        mlp: LlamaMLP = layer.mlp  # type: ignore[assignment]
        self._layer = weakref.ref(layer)
        self.attention = attention
        self.dtype = layer.input_layernorm.weight.dtype
        key = _LINEAR_KERNEL[self.dtype]
        # (module, its kernel, its weight): a call checks that none has changed. float32
        # layers without a packed copy (small weights) multiply through sgemm_ with the weight.
        self.linears: tuple[tuple[nn.Module, AmxKernel | MklPackedLinear | None,
                                  torch.Tensor], ...] = tuple(
            (module, module.__dict__.get(key), module.weight) for module in (
                attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj))
        # Where each weight's values are: C reads float32 weights through these addresses.
        self._weight_addresses = tuple(w.data_ptr() for _, _, w in self.linears)
        self._key = key
        self.function = load_decode_layer().functions["hitch_decode_layer"]
        # The attention backend's settings are read at the first call (the engine binds it
        # after loading the model) and whenever it is bound anew.
        self._impl: CpuAttentionImpl | None = None
        self._params: _LayerParams | None = None

    @property
    def layer(self) -> LlamaDecoderLayer:
        """The layer this kernel computes (alive while it can call this kernel)."""
        layer = self._layer()
        assert layer is not None, "the layer is gone: nothing can call its kernel"
        return layer

    def _layer_params(self, impl: CpuAttentionImpl) -> _LayerParams:
        if self._params is not None and impl is self._impl:
            return self._params
        layer, attention = self.layer, self.attention
        functions = load_fused_ops().functions
        q_norm = k_norm = None
        qk_eps = 0.0
        if attention.qk_norm:
            q_norm, k_norm = attention.q_norm.weight.data_ptr(), attention.k_norm.weight.data_ptr()
            qk_eps = attention.q_norm.eps
        if self.dtype == torch.bfloat16:
            amx, sgemm, compute = _address(load_amx_linear().functions["hitch_amx_linear"]), 0, 0
            packed = [k.packed.data_ptr() if isinstance(k, AmxKernel) else 0
                      for _, k, _ in self.linears]
            weights = [0] * 4
        else:
            amx, (sgemm, compute) = 0, mkl_linear.gemm_addresses()
            packed = [k.packed_address if isinstance(k, MklPackedLinear) else 0
                      for _, k, _ in self.linears]
            weights = [weight.data_ptr() for _, _, weight in self.linears]
        rotary = attention.rotary
        (_, _, qkv), _, _, (_, _, down) = self.linears
        self._params = _LayerParams(
            _DTYPE_CODE[self.dtype], _address(functions["hitch_rms_norm"]), amx, sgemm, compute,
            _address(functions["hitch_rotary"]), _address(functions["hitch_write_kv"]),
            _address(functions["hitch_silu_and_mul"]), _address(load_kernel().function),
            _address(load_kernel().claim),
            layer.input_layernorm.weight.data_ptr(),
            layer.post_attention_layernorm.weight.data_ptr(), q_norm, k_norm,
            layer.input_layernorm.eps, layer.post_attention_layernorm.eps, qk_eps,
            (_P * 4)(*packed), (_P * 4)(*weights), mkl_linear.MIN_ROWS,
            qkv.shape[1], attention.num_heads, attention.num_kv_heads, attention.head_dim,
            down.shape[1], rotary.cos.data_ptr(), rotary.sin.data_ptr(), rotary.cos.shape[0],
            impl.scale, impl.spec.logits_soft_cap or 0.0, impl.spec.sliding_window or 0)
        self._impl = impl
        return self._params

    def __call__(
        self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        rows = hidden.shape[0]
        attn = self.attention.attn
        impl, kv_cache = attn.impl, attn.kv_cache
        context = get_forward_context()
        metadata = context.attn_metadata
        if (hidden.dtype != self.dtype or hidden.dim() != 2 or not 1 <= rows <= MAX_ROWS
                or not hidden.is_contiguous() or torch.is_grad_enabled()
                or (residual is not None and not residual.is_contiguous())
                or not isinstance(impl, CpuAttentionImpl) or kv_cache is None
                or kv_cache.dtype != self.dtype or not kv_cache.is_contiguous()
                or context.split_attention is not None
                or not isinstance(metadata, CpuAttentionMetadata) or metadata.prompts
                or metadata.kernel is None or len(metadata.slot_mapping) != rows
                or not metadata.slot_mapping.is_contiguous()
                or metadata.slot_mapping.dtype != torch.int64
                or positions.shape != (rows,) or positions.dtype != torch.int64
                or not positions.is_contiguous()
                or any(module.__dict__.get(self._key) is not kernel or module.weight is not weight
                       or weight.data_ptr() != address
                       or type(module.linear_method) is not UnquantizedLinearMethod
                       for (module, kernel, weight), address
                       in zip(self.linears, self._weight_addresses, strict=True))
                or (self.dtype == torch.float32 and not mkl_linear.exact_float32())):
            return None
        out, total = torch.empty_like(hidden), torch.empty_like(hidden)
        # kv_cache: [2 (keys, values), kv_heads, blocks, block_size, d], contiguous.
        blocks, block_size = kv_cache.shape[2], kv_cache.shape[3]
        keys = kv_cache.data_ptr()
        values = keys + kv_cache.stride(0) * kv_cache.element_size()
        status = self.function(
            ctypes.byref(self._layer_params(impl)),
            ctypes.byref(_step_params(metadata, positions)), hidden.data_ptr(),
            None if residual is None else residual.data_ptr(), out.data_ptr(),
            total.data_ptr(), keys, values, blocks, block_size, rows, torch.get_num_threads())
        if status != 0:
            self._raise(status, positions, kv_cache)
        return out, total

    def _raise(self, status: int, positions: torch.Tensor, kv_cache: torch.Tensor) -> None:
        if status == _BAD_POSITION:
            table = self.attention.rotary.cos.shape[0]
            bad = positions[(positions < 0) | (positions >= table)]
            raise IndexError(f"rotary: position {int(bad[0])} is outside the rotary tables "
                             f"(max_position_embeddings {table}); keep prompts and "
                             "max_model_len within the model's context length")
        if status == _BAD_SLOT:
            raise IndexError(f"CPU_ATTN: a slot in the slot mapping is outside the KV cache "
                             f"({kv_cache.shape[2] * kv_cache.shape[3]} slots)")
        if status == _NO_MEMORY:
            raise MemoryError("CPU_ATTN's decode layer could not allocate its scratch buffers")
        if status == _NO_EXP:
            raise RuntimeError("CPU_ATTN's decode layer: float32 SiLU has no exponential (the "
                               "check against F.silu failed after this layer was installed); "
                               "restart the engine, or run without the CPU_ATTN plugin")
        raise RuntimeError(f"CPU_ATTN's decode layer failed (status {status}): a layer shape "
                           "its kernels do not take")


def takes(layer: nn.Module) -> bool:
    """Whether ``layer`` is a dense, unsharded Llama-family layer without biases, whose four
    linears have the shapes decode_layer.c derives from the head counts, with norms in the
    model dtype and float32 rotary tables of ``[max_position, head_dim / 2]``; in bfloat16 its
    linears run on the AMX kernel, in float32 the fused kernels equal PyTorch's
    (``fused.float32_exact``) and libtorch exports MKL's GEMMs."""
    if type(layer) is not LlamaDecoderLayer or type(layer.mlp) is not LlamaMLP \
            or type(layer.self_attn) is not LlamaAttention:
        return False
    attention, mlp = layer.self_attn, layer.mlp
    dtype = layer.input_layernorm.weight.dtype
    if dtype == torch.bfloat16:
        kernel_type: type = AmxKernel
    elif dtype == torch.float32 and fused.float32_exact() and mkl_linear.available():
        kernel_type = MklPackedLinear
    else:
        return False
    linears = (attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj)
    for m in linears:
        kernel = m.__dict__.get(_LINEAR_KERNEL[dtype])
        if (m.bias is not None or m.tp_size != 1  # tp_size > 1: o/down sum across ranks
                or type(m.linear_method) is not UnquantizedLinearMethod
                or m.weight.dtype != dtype or m.weight.dim() != 2
                or not m.weight.is_contiguous()
                or not (isinstance(kernel, kernel_type)
                        or (kernel is None and dtype == torch.float32))):
            return False
    (qkv_n, hidden), (o_n, o_k), (gate_up_n, gate_up_k), (down_n, down_k) = (
        tuple(m.weight.shape) for m in linears)
    heads, kv_heads, d = attention.num_heads, attention.num_kv_heads, attention.head_dim
    if (qkv_n != (heads + 2 * kv_heads) * d or o_k != heads * d
            or not o_n == down_n == hidden or gate_up_n != 2 * down_k or gate_up_k != hidden
            or (dtype == torch.float32 and hidden >= fused.SPLIT_ROW)):
        return False  # float32 norms of rows that long: ATen sums them in parts
    cos, sin = attention.rotary.cos, attention.rotary.sin
    if any(t.dtype != torch.float32 or not t.is_contiguous() or t.dim() != 2
           or t.shape[1] != d // 2 or t.shape != cos.shape for t in (cos, sin)):
        return False
    norms = [layer.input_layernorm, layer.post_attention_layernorm]
    if attention.qk_norm:
        norms += [attention.q_norm, attention.k_norm]
    return all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in norms)


def install(model: nn.Module) -> int:
    """Attach a ``DecodeLayerKernel`` to every layer of ``model`` it takes (after the linear
    kernels' and the fused kernels' ``install``); returns how many layers."""
    count = 0
    for module in model.modules():
        if takes(module):
            module.__dict__[LAYER_KERNEL] = DecodeLayerKernel(module)  # type: ignore[arg-type]
            count += 1
    return count
