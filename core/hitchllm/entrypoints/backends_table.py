"""``hitchllm backends``: every discovered attention backend, its origin and validity."""

from __future__ import annotations

import torch

from hitchllm.attention import FP8_DTYPES, AttentionSpec
from hitchllm.attention.selector import (
    AttentionBackendError,
    rank_backends,
    select_attention_backend,
)
from hitchllm.config import ModelConfig, parse_dtype, parse_kv_cache_dtype
from hitchllm.plugins import PluginRegistry, get_plugin_registry

# The shape shown when no model is given: 32 query heads, 8 KV heads, head size 128.
_DEFAULT_SHAPE = {"head_size": 128, "num_heads": 32, "num_kv_heads": 8}


def _spec(
    model: str | None, device_name: str, dtype_name: str, block_size: int, kv_cache_dtype: str
) -> AttentionSpec:
    if device_name == "auto":
        device_name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device_name)
    if dtype_name == "auto":
        dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    else:
        dtype = parse_dtype(dtype_name)
    shape = dict(_DEFAULT_SHAPE)
    window, use_mla = None, False
    if model is not None:
        mc = ModelConfig.from_pretrained(model)
        # As the engine builds it: an MLA model caches one latent vector per token.
        shape = {"head_size": mc.mla_latent_width or mc.head_dim,
                 "num_heads": mc.num_attention_heads,
                 "num_kv_heads": 1 if mc.use_mla else mc.num_key_value_heads}
        window, use_mla = mc.sliding_window, mc.use_mla
    return AttentionSpec.for_device(
        device, dtype=dtype, kv_cache_dtype=parse_kv_cache_dtype(kv_cache_dtype, dtype),
        block_size=block_size, use_mla=use_mla,
        sliding_window=window, **shape,
    )


def _fp8_scales_line(registry: PluginRegistry) -> str:
    """Which plugin settles an fp8 cache's scales, or that engines will refuse fp8."""
    impls = registry.pm.hook.hitchllm_kv_cache_scales.get_hookimpls()
    found = sorted({f"{registry.info_for(i.plugin).distribution} "
                    f"{registry.info_for(i.plugin).version}" for i in impls})
    if found:
        return f"fp8 KV-cache scales from: {', '.join(found)}"
    return ("fp8 KV cache: no plugin provides its scales, so engines refuse it; install "
            "hitchllm-quantization (pip install hitchllm-quantization)")


def print_backends(
    model: str | None, device: str, dtype: str, block_size: int, kv_cache_dtype: str = "auto"
) -> int:
    """Print the table; returns a process exit code (1 when no backend is valid)."""
    spec = _spec(model, device, dtype, block_size, kv_cache_dtype)
    registry = get_plugin_registry()
    candidates = rank_backends(spec, registry)
    print(f"device {spec.device_type}"
          + (f" (sm_{spec.device_capability[0]}{spec.device_capability[1]})"
             if spec.device_capability else "")
          + f", dtype {str(spec.dtype).removeprefix('torch.')}"
          + (f", KV cache {str(spec.kv_cache_dtype).removeprefix('torch.')}"
             if spec.kv_cache_dtype != spec.dtype else "")
          + f", head size {spec.head_size}"
          + (" (MLA latent)" if spec.use_mla else "")
          + f", heads {spec.num_heads}/{spec.num_kv_heads}, block size {spec.block_size}")
    if spec.kv_cache_dtype in FP8_DTYPES:
        print(_fp8_scales_line(registry))
    rows = [("NAME", "PRIORITY", "FROM", "VALID")]
    for c in candidates:
        rows.append((c.name, str(c.backend.priority),
                     f"{c.source.distribution} {c.source.version}",
                     "yes" if c.valid else "no: " + "; ".join(c.reasons)))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(col.ljust(w) for col, w in zip(r[:3], widths)) + "  " + r[3])
    for failed in registry.failed:
        print(f"plugin {failed.name} ({failed.distribution} {failed.version}) failed to load: "
              f"{failed.error}")
    try:
        chosen = select_attention_backend(spec, registry=registry)
    except AttentionBackendError as exc:
        print(f"auto mode: {exc}")
        return 1
    print(f"auto mode picks: {chosen.name}")
    return 0
