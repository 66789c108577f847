"""Where each data-parallel replica runs: its GPUs, or its share of the CPU cores, given to
it through the environment it is started with."""

from __future__ import annotations

import os

from hitchllm.config import EngineConfig
from hitchllm.cpu_threads import usable_cpus


def replica_environments(config: EngineConfig, num_replicas: int) -> list[dict[str, str]]:
    """The environment each replica process starts with: its CUDA devices (slice ``i`` of
    the size of one replica's tensor x pipeline parallel group), or on the CPU its share of
    the cores this process may use (affinity and cgroup CPU quota, ``usable_cpus``).
    ``ValueError`` when there are not enough devices. A single engine process (one replica)
    inherits this process's environment: the devices and threads it would have used here."""
    if num_replicas == 1:
        return [{}]
    device = config.resolve_device()
    if device.type == "cuda":
        if device.index is not None:
            raise ValueError(f"device={config.device!r} pins one GPU, but each data-parallel "
                             "replica gets GPUs of its own; use --device cuda (or auto) and "
                             "choose the GPUs with CUDA_VISIBLE_DEVICES")
        import torch

        group = config.tensor_parallel_size * config.pipeline_parallel_size
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        devices = ([d.strip() for d in visible.split(",") if d.strip()] if visible
                   else [str(i) for i in range(torch.cuda.device_count())])
        if num_replicas * group > len(devices):
            raise ValueError(
                f"data_parallel_size={num_replicas} replicas of {group} GPU(s) each need "
                f"{num_replicas * group} GPUs, but {len(devices)} are visible; lower "
                "--data-parallel-size (or the parallel size of each replica)")
        return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[i * group:(i + 1) * group])}
                for i in range(num_replicas)]
    if "OMP_NUM_THREADS" in os.environ:
        return [{} for _ in range(num_replicas)]
    threads = str(max(1, usable_cpus() // num_replicas))
    return [{"OMP_NUM_THREADS": threads} for _ in range(num_replicas)]
