"""Reading a PEFT LoRA adapter directory into per-layer tensors for one model.

A PEFT adapter is ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ...)
plus ``adapter_model.safetensors`` holding, for each adapted module ``M``,
``base_model.model.M.lora_A.weight`` (``[r, in]``) and ``M.lora_B.weight`` (``[out, r]``).
The adapted layer computes ``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with rslora).

Adapters are checked against the model when read: every problem is a ``ValueError`` that says
what is wrong with the directory and what to change.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from hitchllm.lora import LoRARequest
from hitchllm_lora.targets import SUPPORTED_TARGETS, Target

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
# adapter_config.json switches whose non-default value changes the math: refused.
_UNSUPPORTED_SWITCHES = {
    "use_dora": "DoRA (use_dora)",
    "lora_bias": "a LoRA bias (lora_bias)",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
    "use_qalora": "QA-LoRA (use_qalora)",
}
_UNSUPPORTED_SETTINGS = {
    "modules_to_save": "modules_to_save (fully trained extra modules)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "layer_replication": "layer_replication",
    "target_parameters": "target_parameters",
    "trainable_token_indices": "trainable_token_indices",
}


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted slice of a layer, in this rank's tensor-parallel layout: ``a`` is
    ``[r, in_local]``, ``b`` is ``[out_local, r]``."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoRAAdapter:
    """An adapter read for one model, held in host memory.

    ``weights`` maps ``(layer prefix, shard id)`` (``("model.layers.0.self_attn.qkv_proj",
    "q")``) to the slice's weights; slices it does not adapt are absent.
    """

    request: LoRARequest
    rank: int
    scaling: float
    weights: dict[tuple[str, Any], LoRAWeights]

    @property
    def num_bytes(self) -> int:
        return sum(w.a.nbytes + w.b.nbytes for w in self.weights.values())


def read_adapter(
    request: LoRARequest, targets: dict[str, Target], max_rank: int, dtype: torch.dtype,
    pin_memory: bool = False,
) -> LoRAAdapter:
    """Read ``request.lora_path`` for the model whose adaptable modules are ``targets``
    (PEFT module name, e.g. ``"model.layers.0.self_attn.q_proj"`` -> where it lives).
    Tensors are cast to ``dtype`` and kept on the host (pinned with ``pin_memory``)."""
    name = request.lora_name
    path = Path(request.lora_path)
    where = f"LoRA adapter {name!r} ({path})"
    if not path.is_dir():
        raise ValueError(f"{where}: no such directory; lora_path must be a PEFT adapter "
                         f"directory with {CONFIG_FILE} and {WEIGHTS_FILE}")
    config = _read_config(path, where)
    rank, scaling = _rank_and_scaling(config, where, max_rank)
    tensors = _read_tensors(path, where)
    pairs = _pair_tensors(tensors, where)
    weights: dict[tuple[str, Any], LoRAWeights] = {}
    for module, (a, b) in pairs.items():
        target = targets.get(module)
        if target is None:
            raise ValueError(f"{where}: it adapts module {module!r}, which this model lacks "
                             "(an adapter trained for another base model?)")
        if a.shape[0] != rank or b.shape[1] != rank:
            raise ValueError(f"{where}: {module} has rank {a.shape[0]}/{b.shape[1]} "
                             f"(lora_A/lora_B) but adapter_config.json says r={rank}")
        try:
            a_local, b_local = target.local_weights(a.to(dtype), b.to(dtype))
        except ValueError as exc:
            raise ValueError(f"{where}: {module} does not fit this model: {exc}") from exc
        if pin_memory:
            a_local, b_local = a_local.pin_memory(), b_local.pin_memory()
        weights[(target.layer_prefix, target.shard_id)] = LoRAWeights(a_local, b_local)
    if not weights:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no lora_A/lora_B weights")
    return LoRAAdapter(request, rank, scaling, weights)


def _read_config(path: Path, where: str) -> dict[str, Any]:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"{where}: {CONFIG_FILE} is missing; save the adapter with PEFT's "
                         "save_pretrained")
    try:
        config = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{where}: {CONFIG_FILE} must hold a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"{where}: peft_type is {peft_type!r}; only LORA adapters are served")
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias is {config['bias']!r}; only bias='none' adapters are "
                         "served (train with bias='none')")
    for key, what in _UNSUPPORTED_SWITCHES.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported; use a plain LoRA adapter")
    for key, what in _UNSUPPORTED_SETTINGS.items():
        if config.get(key):
            raise ValueError(f"{where}: {what} is not supported (got {config[key]!r})")
    modules = config.get("target_modules")
    if isinstance(modules, list):
        unknown = sorted(set(modules) - set(SUPPORTED_TARGETS))
        if unknown:
            raise ValueError(f"{where}: target modules {unknown} are not supported; LoRA "
                             f"applies to {', '.join(SUPPORTED_TARGETS)}")
    return config


def _rank_and_scaling(config: dict[str, Any], where: str, max_rank: int) -> tuple[int, float]:
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, got {rank!r}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha must be a number, got {alpha!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank={max_rank}; start the "
                         f"engine with max_lora_rank >= {rank} (--max-lora-rank)")
    denominator = math.sqrt(rank) if config.get("use_rslora") else rank
    return rank, float(alpha) / denominator


def _read_tensors(path: Path, where: str) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        hint = (" (adapter_model.bin is not read: re-save with safe_serialization=True)"
                if (path / "adapter_model.bin").is_file() else "")
        raise ValueError(f"{where}: {WEIGHTS_FILE} is missing{hint}")
    try:
        return load_file(file)
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{where}: {WEIGHTS_FILE} cannot be read ({exc})") from exc


def _pair_tensors(
    tensors: dict[str, torch.Tensor], where: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """PEFT module name -> (lora_A, lora_B); anything else in the file is refused."""
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix(_PREFIX)
        module, _, kind = name.rpartition(".lora_")
        if kind not in ("A.weight", "B.weight") or not module:
            raise ValueError(f"{where}: tensor {key!r} is not a lora_A/lora_B weight (DoRA "
                             "magnitudes, embeddings and biases are not supported)")
        leaf = module.rpartition(".")[2]
        if leaf not in SUPPORTED_TARGETS:
            raise ValueError(f"{where}: target module {leaf!r} ({module}) is not supported; "
                             f"LoRA applies to {', '.join(SUPPORTED_TARGETS)}")
        if tensor.dim() != 2:
            raise ValueError(f"{where}: {key} has shape {tuple(tensor.shape)}, expected 2-D")
        halves.setdefault(module, {})[kind[0]] = tensor
    pairs = {}
    for module, parts in halves.items():
        if set(parts) != {"A", "B"}:
            missing = "lora_B" if "A" in parts else "lora_A"
            raise ValueError(f"{where}: {module} has no {missing} weight")
        pairs[module] = (parts["A"], parts["B"])
    return pairs
