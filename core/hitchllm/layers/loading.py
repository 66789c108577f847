"""Routing checkpoint tensors to parameters through their weight loaders.

A model's ``load_weights`` names its stacked projections (checkpoint ``q_proj`` goes to slot
``"q"`` of ``qkv_proj``, ...) and which checkpoint names to skip; ``load_named_weights`` does
the rest: every tensor goes to its parameter's ``weight_loader`` (which slices the rank's shard
and places the slot), and a checkpoint that does not fit fails with every missing and
unexpected tensor listed. Extra tensors a quantization method asks for (``weight_scale``,
...) are parameters of the layer, so they route the same way. A parameter marked
``optional_in_checkpoint`` (an attention layer's fp8 KV-cache scales) loads when the
checkpoint has it and is not missing when it does not.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from hitchllm.layers.method import ShardId, default_weight_loader

Stacking = Mapping[str, tuple[str, ShardId]]
# A checkpoint name -> (parameter name, slot), or None when the rule does not apply.
Route = Callable[[str], tuple[str, ShardId] | None]


def load_named_weights(
    model: nn.Module,
    weights: Iterable[tuple[str, torch.Tensor]],
    stacked: Stacking,
    skip: Callable[[str], bool],
    description: str,
    rename: Callable[[str], str | None] | None = None,
    route: Route | None = None,
) -> None:
    """Load ``weights`` into ``model``'s parameters; raise ``ValueError`` listing what is
    missing and unexpected (``description`` names the model in that message).

    ``stacked`` maps a checkpoint module name to ``(stacked module name, slot)``, e.g.
    ``{"q_proj": ("qkv_proj", "q")}``; ``skip(name)`` is true for checkpoint tensors the model
    does not need (a tied ``lm_head.weight``, rotary caches). ``rename(name)`` gives the
    parameter name of a checkpoint tensor whose name the model spells differently (a
    KV-cache scale, see ``hitchllm.attention.kv_scale_target``), or None; it applies before
    ``stacked``, and errors still quote the checkpoint's name. ``route(name)`` gives
    ``(parameter name, slot)`` for tensors that a rule places rather than the ``stacked``
    table (one expert's projection into a mixture-of-experts layer's stacked weights, see
    ``hitchllm.layers.moe.expert_route``), or None; it applies first.
    """
    params = dict(model.named_parameters())
    loaded: set[tuple[str, ShardId]] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if skip(name):
            continue
        routed = route(name) if route is not None else None
        renamed = rename(name) if rename is not None and routed is None else None
        target, shard = routed or (renamed or name, None)
        for part, (stacked_name, slot) in stacked.items():
            if routed is None and renamed is None and f".{part}." in name:
                target, shard = name.replace(f".{part}.", f".{stacked_name}."), slot
                break
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            loader(param, tensor, shard)
        except ValueError as err:
            raise ValueError(f"checkpoint tensor {name!r}: {err}") from err
        slots = getattr(param, "shard_ids", (None,))
        loaded.update([(target, shard)] if shard is not None else ((target, s) for s in slots))
    missing = [
        name if slot is None else f"{name}[{slot}]"
        for name, param in params.items()
        for slot in getattr(param, "shard_ids", (None,))
        if (name, slot) not in loaded and not getattr(param, "optional_in_checkpoint", False)
    ]
    problems = []
    for what, names in (("is missing", missing), ("has unexpected", unexpected)):
        if names:
            more = f" and {len(names) - 8} more" if len(names) > 8 else ""
            problems.append(f"{what} {len(names)} tensors: {', '.join(names[:8])}{more}")
    if problems:
        raise ValueError(f"the checkpoint does not fit {description}: it "
                         + "; it ".join(problems))


def process_weights_after_loading(model: nn.Module) -> None:
    """Give every layer's linear method (and mixture-of-experts method) its
    ``process_weights_after_loading`` call."""
    for module in model.modules():
        for attr in ("linear_method", "moe_method"):
            method = getattr(module, attr, None)
            if method is not None:
                method.process_weights_after_loading(module)
