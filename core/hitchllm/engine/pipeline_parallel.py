"""Start-up checks for pipeline parallelism: what would fail later in a worker (or run the
wrong layers) is refused here, before any process starts, with what to change."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hitchllm.config import EngineConfig, ModelConfig
from hitchllm.models.loader import model_architectures
from hitchllm.models.pipeline import stage_layers
from hitchllm.plugins import PluginRegistry


def check_pipeline_parallel(
    config: EngineConfig, model_config: ModelConfig, device: torch.device,
    registry: PluginRegistry,
) -> None:
    """Refuse a pipeline-parallel configuration that cannot run (``ValueError``): more stages
    than decoder layers, a model class that cannot be split into stages, speculative
    decoding, LoRA or the Ray backend (not with stages yet), fewer GPUs than tensor x
    pipeline ranks, no NCCL / gloo."""
    pp, tp = config.pipeline_parallel_size, config.tensor_parallel_size
    if pp == 1:
        return
    stage_layers(model_config.num_hidden_layers, pp, 0)
    cls = model_architectures(registry).get(model_config.architecture)
    if cls is not None and not getattr(cls, "SUPPORTS_PIPELINE_PARALLEL", False):
        raise ValueError(
            f"{model_config.architecture} ({cls.__module__}.{cls.__name__}) cannot be split "
            "into pipeline stages yet; use pipeline_parallel_size=1 (tensor_parallel_size "
            "may still split it)")
    if config.distributed_executor_backend == "ray":
        raise ValueError("pipeline stages run as worker processes on this host only "
                         "(distributed_executor_backend='mp'), not on Ray yet; use "
                         "pipeline_parallel_size=1 with Ray, or the mp backend")
    for name, asked in (("speculative decoding (speculative_method)", config.speculative_method),
                        ("LoRA (enable_lora)", config.enable_lora)):
        if asked:
            raise ValueError(f"{name} does not run with pipeline_parallel_size > 1 yet; use "
                             "pipeline_parallel_size=1 or turn it off")
    world = tp * pp
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(
                f"device={str(device)!r} names one card, but pipeline_parallel_size={pp} runs "
                "global rank r on cuda:r; use device='cuda' and choose the cards with "
                "CUDA_VISIBLE_DEVICES")
        visible = torch.cuda.device_count()
        if visible < world:
            raise ValueError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs {world} GPUs "
                f"(one per rank) but {visible} {'is' if visible == 1 else 'are'} visible; "
                "lower the sizes, make more cards visible (CUDA_VISIBLE_DEVICES), or run the "
                "ranks as CPU processes with device='cpu'")
        if not dist.is_nccl_available():
            raise ValueError(
                "pipeline parallelism on CUDA needs NCCL, which this PyTorch build lacks; "
                "install a PyTorch build with NCCL (the CUDA wheels from pytorch.org have it)")
    elif not dist.is_gloo_available():
        raise ValueError("pipeline parallelism on the CPU needs torch.distributed's gloo "
                         "backend, which this PyTorch build lacks; install a build with gloo")
