"""Start-up checks for tensor parallelism: everything that would fail later in a worker (or
silently give a wrong split) is refused here, before any process starts, with what to change."""

from __future__ import annotations

import torch
import torch.distributed as dist

from hitchllm.config import EngineConfig, ModelConfig


def _divisors(n: int) -> str:
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0)


def heads_per_rank(model_config: ModelConfig, tp_size: int) -> tuple[int, int]:
    """One rank's query and KV heads with ``tp_size`` ranks; KV heads are replicated (one per
    rank) when there are fewer of them than ranks. Raises ``ValueError`` for a split that
    does not divide evenly."""
    heads, kv_heads = model_config.num_attention_heads, model_config.num_key_value_heads
    if heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's {heads} attention "
            f"heads; use a tensor_parallel_size that divides {heads} ({_divisors(heads)})")
    if kv_heads >= tp_size and kv_heads % tp_size:
        raise ValueError(
            f"tensor_parallel_size={tp_size} does not divide the model's {kv_heads} key/value "
            f"heads; use one that divides {kv_heads} ({_divisors(kv_heads)}) or a multiple "
            f"of {kv_heads} (each key/value head is then replicated)")
    if kv_heads < tp_size and tp_size % kv_heads:
        raise ValueError(
            f"the model's {kv_heads} key/value heads cannot be replicated evenly over "
            f"tensor_parallel_size={tp_size} ranks; use a multiple of {kv_heads}, or a "
            f"divisor of it ({_divisors(kv_heads)})")
    return heads // tp_size, max(1, kv_heads // tp_size)


def check_tensor_parallel(
    config: EngineConfig, model_config: ModelConfig, device: torch.device
) -> None:
    """Refuse a tensor-parallel configuration that cannot run: a model whose heads or MLP do
    not split, features that do not run with several ranks (or on Ray) yet, too few GPUs, or
    no NCCL (``ValueError``, naming the fix). On Ray the GPUs are the cluster's, not this
    host's: the Ray executor checks that the cluster can place every rank."""
    tp = config.tensor_parallel_size
    on_ray = config.distributed_executor_backend == "ray"
    if tp == 1 and not on_ray:
        return
    heads_per_rank(model_config, tp)
    if model_config.intermediate_size % tp:
        raise ValueError(
            f"tensor_parallel_size={tp} does not divide the model's intermediate_size "
            f"({model_config.intermediate_size}); use one of "
            f"{_divisors(model_config.intermediate_size)}")
    for name, asked in (("speculative decoding (speculative_method)", config.speculative_method),
                        ("LoRA (enable_lora)", config.enable_lora)):
        if asked and tp > 1:
            raise ValueError(f"{name} does not run with tensor_parallel_size > 1 yet; use "
                             "tensor_parallel_size=1 or turn it off")
        if asked:
            raise ValueError(f"{name} does not run on Ray workers yet; use "
                             "distributed_executor_backend='mp' or turn it off")
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(
                f"device={str(device)!r} names one card, but tensor_parallel_size={tp} runs "
                f"rank r on cuda:r; use device='cuda' and choose the cards with "
                "CUDA_VISIBLE_DEVICES")
        visible = torch.cuda.device_count()
        if visible < tp and not on_ray:
            raise ValueError(
                f"tensor_parallel_size={tp} needs {tp} GPUs (one per rank) but {visible} "
                f"{'is' if visible == 1 else 'are'} visible; lower tensor_parallel_size to at "
                f"most {visible}, make more cards visible (CUDA_VISIBLE_DEVICES), or run the "
                "ranks as CPU processes with device='cpu'")
        if not dist.is_nccl_available():
            raise ValueError(
                "tensor parallelism on CUDA needs NCCL, which this PyTorch build lacks; "
                "install a PyTorch build with NCCL (the CUDA wheels from pytorch.org have it)")
    elif not dist.is_gloo_available():
        raise ValueError("tensor parallelism on the CPU needs torch.distributed's gloo backend, "
                         "which this PyTorch build lacks; install a build with gloo")
