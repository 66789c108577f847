"""``shared_memory``: KV pages as files in a shared-memory directory, for engines on one host.

The producer writes each saved request's pages, per tensor-parallel rank, with
``torch.save`` to ``<path>/<engine id>.<request id>.<rank>.pt`` (under a temporary name, then
renamed, so a reader never sees half a file); the consumer polls for the file named by the
transfer params, loads it into host memory, deletes it, and copies it into its blocks.

Why files in ``/dev/shm``: the kernel's shared memory is the transport, with nothing to
install and no connection between the instances to set up, keep alive or tear down; any
number of producers and consumers on the host can meet in one directory; the atomic rename
is the completion signal; and a consumer that never comes leaves at worst a file the
producer deletes after ``ttl_s``. The cost is one copy in and one out of host memory per
transfer, which suits instances on one machine (use ``torch_distributed`` between GPUs).

Options (``kv_connector_extra_config``): ``path`` (default ``/dev/shm/hitchllm-kv``, or the
temporary directory where there is no ``/dev/shm``), ``ttl_s`` (default 300).
"""

from __future__ import annotations

import os
import tempfile
import time
import urllib.parse
from pathlib import Path
from typing import Any

import torch

from hitchllm.kv_transfer import KVLoad, KVSave, KVTransferConfig
from hitchllm_kv_transfer.background import BackgroundConnector
from hitchllm_kv_transfer.options import check_options

_OPTIONS = {"path": str, "ttl_s": (int, float)}


def default_path() -> Path:
    shm = Path("/dev/shm")
    return (shm if shm.is_dir() else Path(tempfile.gettempdir())) / "hitchllm-kv"


class SharedMemoryConnector(BackgroundConnector):
    """KV pages through files in a shared-memory directory (one host)."""

    name = "shared_memory"

    def __init__(self, config: KVTransferConfig, engine_id: str, rank: int,
                 world_size: int) -> None:
        options = config.kv_connector_extra_config
        self.path = Path(options.get("path") or default_path())
        self.ttl_s = float(options.get("ttl_s", 300))
        self.path.mkdir(parents=True, exist_ok=True)
        self._last_sweep = 0.0
        super().__init__(config, engine_id, rank, world_size)

    @classmethod
    def check_config(cls, config: KVTransferConfig) -> None:
        check_options(cls.name, config.kv_connector_extra_config, _OPTIONS)
        if config.kv_connector_extra_config.get("ttl_s", 1) <= 0:
            raise ValueError("kv_connector_extra_config.ttl_s must be positive")

    @classmethod
    def transfer_params(cls, config: KVTransferConfig, engine_id: str) -> dict[str, Any]:
        return {"path": str(config.kv_connector_extra_config.get("path") or default_path())}

    def _file(self, directory: Path, engine_id: str, request_id: str) -> Path:
        rid = urllib.parse.quote(request_id, safe="")
        return directory / f"{engine_id}.{rid}.{self.rank}.pt"

    def _send(self, save: KVSave, pages: list[torch.Tensor]) -> None:
        final = self._file(self.path, self.engine_id, save.request_id)
        tmp = final.with_suffix(".tmp")
        torch.save([p.cpu() for p in pages], tmp)
        os.replace(tmp, final)
        self._sweep()

    def _try_receive(self, load: KVLoad) -> list[torch.Tensor] | None:
        params = load.params
        file = self._file(Path(params["path"]), params["remote_engine_id"],
                          params["remote_request_id"])
        if not file.exists():
            return None
        pages = torch.load(file, map_location="cpu", weights_only=True)
        file.unlink(missing_ok=True)
        return pages

    def _sweep(self) -> None:
        """Delete this engine's files no consumer took within ``ttl_s`` (at most every
        second)."""
        now = time.time()
        if now - self._last_sweep < 1.0:
            return
        self._last_sweep = now
        for file in self.path.glob(f"{self.engine_id}.*.pt"):
            try:
                if now - file.stat().st_mtime > self.ttl_s:
                    file.unlink()
            except FileNotFoundError:
                pass  # a consumer took it meanwhile

    def close(self) -> None:
        super().close()
        for file in self.path.glob(f"{self.engine_id}.*"):
            file.unlink(missing_ok=True)
