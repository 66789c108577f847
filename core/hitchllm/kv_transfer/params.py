"""Transfer params: what a producer returns with a finished request, and how a consumer
checks what it is given.

A producer's params name its connector and engine, the request whose KV it saved, how many
tokens that KV covers, the block size, and a checksum of the prompt's token ids, plus the
connector's own addressing (``KVConnector.transfer_params``). A consumer accepts them only
for the same connector, block size and prompt; otherwise it logs why and computes the prompt
itself (a wrong prompt must never decode from another prompt's KV).
"""

from __future__ import annotations

import logging
import uuid
import zlib
from typing import Any

from hitchllm.kv_transfer.config import KVTransferConfig
from hitchllm.kv_transfer.connector import KVConnector
from hitchllm.kv_transfer.scheduling import num_transfer_tokens
from hitchllm.request import Request

logger = logging.getLogger(__name__)

# The key a client sets on a producer request whose KV a consumer will load (vLLM's name).
DO_REMOTE_DECODE = "do_remote_decode"
_REQUIRED = ("kv_connector", "remote_engine_id", "remote_request_id", "num_tokens",
             "block_size", "prompt_crc")


def prompt_checksum(token_ids: list[int]) -> int:
    return zlib.crc32(repr(list(token_ids)).encode())


class KVTransferParams:
    """One engine's side of the transfer params (``kv_transfer_config`` set)."""

    def __init__(self, config: KVTransferConfig, connector: type[KVConnector],
                 block_size: int) -> None:
        self.config = config
        self.block_size = block_size
        self.engine_id = uuid.uuid4().hex
        self._addressing = (connector.transfer_params(config, self.engine_id)
                            if config.kv_role == "producer" else {})

    def attach(self, request: Request, params: dict[str, Any] | None) -> None:
        """Set ``request``'s transfer fields from the caller's ``kv_transfer_params``."""
        if params is None:
            return
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be a JSON object")
        if self.config.kv_role == "producer":
            if params.get(DO_REMOTE_DECODE):
                request.kv_transfer_params = dict(params)
                request.kv_transfer_out = {
                    **self._addressing,
                    "kv_connector": self.config.kv_connector,
                    "remote_engine_id": self.engine_id,
                    "remote_request_id": request.request_id,
                    "num_tokens": num_transfer_tokens(request),
                    "block_size": self.block_size,
                    "prompt_crc": prompt_checksum(request.prompt_token_ids),
                }
            return
        missing = [k for k in _REQUIRED if k not in params]
        if missing:
            raise ValueError(
                f"kv_transfer_params lacks {', '.join(missing)}; a consumer engine takes the "
                "kv_transfer_params a producer engine returned for the same prompt")
        why = self._mismatch(request, params)
        if why is not None:
            logger.warning("request %s: kv_transfer_params %s; computing its prompt here",
                           request.request_id, why)
            return
        request.kv_transfer_params = dict(params)

    def _mismatch(self, request: Request, params: dict[str, Any]) -> str | None:
        if params["kv_connector"] != self.config.kv_connector:
            return (f"come from connector {params['kv_connector']!r}, this engine uses "
                    f"{self.config.kv_connector!r}")
        if params["block_size"] != self.block_size:
            return f"have block_size {params['block_size']}, this engine {self.block_size}"
        if (params["num_tokens"] != num_transfer_tokens(request)
                or params["prompt_crc"] != prompt_checksum(request.prompt_token_ids)):
            return "were made for another prompt"
        return None
