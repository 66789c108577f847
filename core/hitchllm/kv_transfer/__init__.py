"""Moving a request's KV cache between engines: disaggregated prefill and decode.

A *producer* engine (``kv_role="producer"``) computes prompts and ships the KV of each
prompt through a *connector*; a *consumer* engine (``kv_role="consumer"``) receives it into
blocks it reserved and decodes from there, without computing the prompt again. Connectors
come from plugins (``hitchllm_kv_connectors``); the core holds the seam: the typed config
(``KVTransferConfig``), the connector interface (``KVConnector``), what a step plan asks the
runner to move (``KVSave``, ``KVLoad``), and the scheduler's bookkeeping
(``KVTransferScheduling``). See docs/disaggregation.md.
"""

from hitchllm.kv_transfer.config import KVTransferConfig
from hitchllm.kv_transfer.connector import (
    KVConnector,
    KVLoad,
    KVSave,
    KVTransferEvents,
    KVTransferStats,
    connector_class,
)

__all__ = [
    "KVConnector",
    "KVLoad",
    "KVSave",
    "KVTransferConfig",
    "KVTransferEvents",
    "KVTransferStats",
    "connector_class",
]
