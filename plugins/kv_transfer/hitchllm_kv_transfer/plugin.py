"""The plugin module: registers this package's KV connectors."""

from __future__ import annotations

from hitchllm import hookimpl
from hitchllm.kv_transfer import KVConnector
from hitchllm_kv_transfer.shared_memory import SharedMemoryConnector
from hitchllm_kv_transfer.torch_distributed import TorchDistributedConnector


@hookimpl
def hitchllm_kv_connectors() -> dict[str, type[KVConnector]]:
    return {SharedMemoryConnector.name: SharedMemoryConnector,
            TorchDistributedConnector.name: TorchDistributedConnector}
