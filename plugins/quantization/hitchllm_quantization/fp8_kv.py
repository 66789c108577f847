"""fp8 KV-cache scales: checked from the checkpoint, or computed from the first prompts served.

Each ``hitchllm.attention.Attention`` layer stores ``K / k_scale`` and ``V / v_scale`` in an
fp8 cache. The core loads a checkpoint's per-layer scales into those parameters (see
``hitchllm.attention.KV_SCALE_CHECKPOINT_NAMES``); this module decides what the engine serves
with, in ``settle_kv_scales`` (the ``hitchllm_kv_cache_scales`` hook):

- the checkpoint's scales when it has them for every layer;
- with ``calculate_kv_scales``, scales computed from the first step that serves prompts
  (``KVScaleCalibration``): ``amax(|K|) / max(fp8)`` per layer, likewise for V;
- else 1.0, which only rounds K/V to fp8 (fine for models whose K/V stay well inside the
  format's range, lossy for tiny values that land in the subnormals).

A compressed-tensors checkpoint declares its KV-cache quantization in
``quantization_config.kv_cache_scheme`` (``{"num_bits": 8, "type": "float", "strategy":
"tensor"}``); only that per-tensor fp8 scheme is served.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

import torch
from torch import nn

from hitchllm.attention import FP8_DTYPES, Attention, real_rows

# A child of the core's "hitchllm" logger, so these lines show where the engine's own do.
logger = logging.getLogger("hitchllm.quantization")

#: The compressed-tensors ``kv_cache_scheme`` values this plugin serves.
SUPPORTED_KV_CACHE_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor"}


def attention_layers(model: nn.Module) -> list[Attention]:
    """The model's attention layers, in layer order."""
    return sorted((m for m in model.modules() if isinstance(m, Attention)),
                  key=lambda m: m.layer_index)


def kv_cache_scheme(hf_config: dict[str, Any]) -> dict[str, Any] | None:
    """The checkpoint's compressed-tensors ``kv_cache_scheme``, or None. Raises ``ValueError``
    for a scheme other than per-tensor fp8, saying what is served."""
    scheme = (hf_config.get("quantization_config") or {}).get("kv_cache_scheme")
    if scheme is None:
        return None
    wrong = {key: scheme.get(key) for key, want in SUPPORTED_KV_CACHE_SCHEME.items()
             if scheme.get(key) != want}
    if wrong:
        raise ValueError(
            f"quantization_config.kv_cache_scheme {scheme} is not supported ({wrong}); "
            f"hitchllm-quantization serves per-tensor fp8 KV-cache scales "
            f"({SUPPORTED_KV_CACHE_SCHEME}); drop kv_cache_scheme from config.json to serve "
            "the model without its KV-cache quantization")
    return scheme


def settle_kv_scales(
    model: nn.Module, hf_config: dict[str, Any], kv_cache_dtype: torch.dtype,
    calculate: bool,
) -> KVScaleCalibration | None:
    """Check the scales the core loaded and log what the engine serves with; returns the
    calibration to arm at the first step that serves prompts when ``calculate`` is set.
    Raises ``ValueError`` for a checkpoint whose KV-cache scales cannot be served."""
    if kv_cache_dtype not in FP8_DTYPES:
        if (hf_config.get("quantization_config") or {}).get("kv_cache_scheme") is not None:
            logger.info("the checkpoint declares an fp8 KV cache (quantization_config."
                        "kv_cache_scheme); kv_cache_dtype=auto keeps the model dtype, use "
                        "--kv-cache-dtype fp8 to serve fp8 KV with its scales")
        return None
    scheme = kv_cache_scheme(hf_config)
    layers = attention_layers(model)
    missing = [layer.layer_index for layer in layers if not (
        layer.k_scale.from_checkpoint and layer.v_scale.from_checkpoint)]
    name = str(kv_cache_dtype).removeprefix("torch.")
    if calculate:
        logger.info("fp8 KV cache (%s): k_scale/v_scale of %d layers are computed from the "
                    "first prompts served (calculate_kv_scales)%s", name, len(layers),
                    "" if len(missing) == len(layers) else
                    ", replacing the checkpoint's")
        return KVScaleCalibration(layers, kv_cache_dtype)
    if scheme is not None or len(missing) < len(layers):
        if len(missing) == len(layers):
            raise ValueError(
                "the checkpoint declares an fp8 KV cache (quantization_config.kv_cache_scheme) "
                "but holds no k_scale/v_scale tensors; use --calculate-kv-scales to compute "
                "them from the first prompts, or kv_cache_dtype=auto")
        if missing:
            raise ValueError(
                f"the checkpoint has fp8 KV-cache scales (k_scale and v_scale) for "
                f"{len(layers) - len(missing)} of {len(layers)} attention layers; missing for "
                f"layers {missing[:8]}{' ...' if len(missing) > 8 else ''}; use a complete "
                "checkpoint, or --calculate-kv-scales to compute them from the first prompts")
        scales = torch.stack([s for layer in layers for s in (layer.k_scale, layer.v_scale)])
        logger.info("fp8 KV cache (%s): k_scale/v_scale of %d layers from the checkpoint "
                    "(%.4g to %.4g)", name, len(layers), float(scales.min()),
                    float(scales.max()))
        return None
    logger.info("fp8 KV cache (%s): the checkpoint has no KV-cache scales, so k_scale = "
                "v_scale = 1.0 (--calculate-kv-scales computes them from the first prompts)",
                name)
    return None


class KVScaleCalibration:
    """Sets each layer's ``k_scale`` / ``v_scale`` from the K and V of one forward pass.

    ``arm()`` puts a forward pre-hook on every attention layer; the hook computes the layer's
    scales from the step's K and V before the layer writes them to the cache (so that step is
    stored with them too) and removes itself. Everything stays on the device: no
    synchronization, the scales are written in place.
    """

    def __init__(self, layers: list[Attention], fp8: torch.dtype) -> None:
        self.layers = layers
        self.fp8_max = torch.finfo(fp8).max
        self._pending: dict[int, Any] = {}

    def arm(self) -> None:
        for layer in self.layers:
            self._pending[id(layer)] = layer.register_forward_pre_hook(self._calibrate,
                                                                       with_kwargs=True)

    @property
    def done(self) -> bool:
        """Whether every armed layer has computed its scales."""
        return not self._pending

    def _calibrate(
        self, layer: Attention, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor]
    ) -> None:
        _, k, v = (*args, *(kwargs[name] for name in ("q", "k", "v")[len(args):]))
        # A step padded for CUDA-graph pieces: the padding rows are not the prompt's.
        k, v = real_rows(k), real_rows(v)
        for scale, x in ((layer.k_scale, k), (layer.v_scale, v)):
            amax = x.detach().abs().amax().float()
            # An all-zero K (or V) gives no range to fit: keep 1.0 rather than divide by 0.
            scale.copy_(torch.where(amax > 0, amax / self.fp8_max, torch.ones_like(amax)))
        self._pending.pop(id(layer)).remove()


# Calibrations waiting for their model's first step that serves prompts (weak: an engine that
# is dropped before serving anything leaves nothing behind).
_waiting: weakref.WeakKeyDictionary[nn.Module, KVScaleCalibration] = (
    weakref.WeakKeyDictionary())


def wait_for_first_step(model: nn.Module, calibration: KVScaleCalibration) -> None:
    """Arm ``calibration`` when ``model``'s first step that serves prompts begins."""
    _waiting[model] = calibration


def first_step_begins(model: nn.Module) -> None:
    """Called before every served step: arms the model's waiting calibration, once."""
    calibration = _waiting.pop(model, None)
    if calibration is not None:
        calibration.arm()
