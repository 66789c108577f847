"""One engine process: a replica of data-parallel serving, or the engine of a one-engine
server that runs it in a process of its own (``--engine-process``). It builds the engine and
serves the server's requests over a pipe with a ``ReplicaServer`` (``pipe_engine.py``).
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from hitchllm.data_parallel.messages import Ready, StartFailed, WireError
from hitchllm.lora import LoRARequest

if TYPE_CHECKING:
    from hitchllm.config import EngineConfig

logger = logging.getLogger(__name__)


@dataclass
class ReplicaSpec:
    """What a replica process is started with."""

    index: int
    config: EngineConfig
    # The model name its metrics are labelled with, and max_loras when LoRA is on.
    metrics_name: str
    max_loras: int | None = None
    # Adapters loaded before it reports ready (``--lora-modules``).
    lora_modules: list[LoRARequest] = field(default_factory=list)


def run_replica(spec: ReplicaSpec, conn: Connection) -> None:
    """The replica process's entry point (its devices and threads are set by the
    environment the server started it with)."""
    # Ctrl-C reaches the whole process group, and so does SIGTERM where a service manager
    # stops the group (systemd); the server drains its requests, then stops its replicas
    # itself (a no-op handler, not SIG_IGN, which processes this one starts would inherit).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: None)
    from hitchllm.data_parallel.pipe_engine import ReplicaServer
    from hitchllm.engine.llm_engine import LLMEngine
    from hitchllm.entrypoints.openai.metrics import ServerMetrics
    from hitchllm.entrypoints.startup import freeze_startup_objects

    try:
        engine = LLMEngine(spec.config)
        for lora in spec.lora_modules:
            engine.add_lora(lora)
    except BaseException as exc:  # the server reports it and stops the other replicas
        if isinstance(exc, ValueError):  # a bad argument: the server's one line says it all
            conn.send(StartFailed(WireError.of(exc)))
            return
        logger.exception("data-parallel replica %d failed to start", spec.index)
        conn.send(StartFailed(WireError("internal", f"{type(exc).__name__}: {exc}")))
        return
    metrics = ServerMetrics(spec.metrics_name, spec.max_loras)
    server = ReplicaServer(spec.index, conn, engine, metrics)
    freeze_startup_objects()
    try:
        server.send(Ready(os.getpid(), engine.max_model_len, engine.list_loras(),
                          str(engine.device), _gpu_uuids(engine.device)))
        server.serve()
    finally:
        server.shutdown()


def _gpu_uuids(device: Any) -> list[str]:
    """The UUIDs of the GPUs this process sees (none off CUDA)."""
    if device.type != "cuda":
        return []
    import torch

    return [str(torch.cuda.get_device_properties(i).uuid)
            for i in range(torch.cuda.device_count())]
