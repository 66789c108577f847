"""``KVTransferConfig``: which connector an engine moves KV through, and in which role."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

KVRole = Literal["producer", "consumer"]


class KVTransferConfig(BaseModel):
    """The ``kv_transfer_config`` engine argument (vLLM's names).

    ``kv_connector`` names a connector a plugin provides (``hitchllm_kv_connectors``; the
    hitchllm-kv-transfer plugin has ``shared_memory`` and ``torch_distributed``).
    ``kv_role``: a *producer* computes prompts and saves their KV for requests that ask for it
    (``kv_transfer_params={"do_remote_decode": true}``), answering with the params a consumer
    needs; a *consumer* loads the KV of requests that arrive with those params and decodes.
    ``kv_connector_extra_config`` holds the connector's own options (a directory, an address);
    the connector checks them at start-up. ``kv_load_timeout_s``: how long a consumer waits
    for a request's KV before it computes the prompt itself.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kv_connector: str = Field(min_length=1)
    kv_role: KVRole
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)
    kv_load_timeout_s: float = Field(30.0, gt=0)
