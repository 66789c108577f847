"""The model names a server answers to, and loading LoRA adapters at run time.

The base model answers to its served names; with ``--enable-lora`` each loaded adapter is a
model of its own name (its card's ``parent`` is the base model), so a request's ``model``
field picks the adapter it runs with. ``POST /v1/load_lora_adapter`` and
``/v1/unload_lora_adapter`` (vLLM's routes and bodies) change the adapters while the server
runs; like vLLM they are refused unless ``HITCHLLM_ALLOW_RUNTIME_LORA_UPDATING`` (or vLLM's
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) is true, because they read any directory the server
can.

The adapters themselves are served by a plugin (``hitchllm-lora``) through the engine
client's ``add_lora`` / ``remove_lora`` / ``list_loras`` (with data parallelism, every
replica loads each adapter); nothing here depends on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from hitchllm.engine.engine_client import EngineClient
from hitchllm.lora import LORA_PLUGIN, LoRARequest

logger = logging.getLogger(__name__)

RUNTIME_LORA_UPDATING_VARS = ("HITCHLLM_ALLOW_RUNTIME_LORA_UPDATING",
                              "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating_allowed(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment allows loading and unloading adapters while serving."""
    return any(environ.get(var, "").strip().lower() in ("1", "true")
               for var in RUNTIME_LORA_UPDATING_VARS)


class APIError(Exception):
    """An error answered in OpenAI's JSON shape with ``status``."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


class LoadLoRAAdapterRequest(BaseModel):
    """The body of ``POST /v1/load_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """The body of ``POST /v1/unload_lora_adapter`` (``lora_int_id`` is vLLM's; adapters are
    known by name, so it is accepted and unused)."""

    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


class ServedModels:
    """The base model's served names and the engine's LoRA adapters, as API models."""

    def __init__(self, engine: EngineClient, base_names: list[str],
                 allow_runtime_lora_updating: bool = False) -> None:
        self.engine = engine
        self.base_names = base_names
        self.allow_runtime_lora_updating = allow_runtime_lora_updating

    def adapters(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def names(self) -> list[str]:
        """Every name a request may give as ``model``: the base model's, then the adapters'."""
        return self.base_names + [a.lora_name for a in self.adapters()]

    def lora_request(self, name: str) -> LoRARequest | None:
        """The adapter that model ``name`` runs with (None: the base model); ``APIError``
        404 listing the known names when there is no such model."""
        if name in self.base_names:
            return None
        for adapter in self.adapters():
            if adapter.lora_name == name:
                return LoRARequest(adapter.lora_name, adapter.lora_int_id)
        raise self._not_found(name)

    def cards(self) -> list[dict[str, Any]]:
        """``/v1/models``' entries."""
        base = self.base_names[0]
        return ([self._card(name) for name in self.base_names]
                + [self._card(a.lora_name, root=a.lora_path, parent=base)
                   for a in self.adapters()])

    def card(self, name: str) -> dict[str, Any]:
        """The card of model ``name`` (``APIError`` 404 if unknown)."""
        for card in self.cards():
            if card["id"] == name:
                return card
        raise self._not_found(name)

    def _not_found(self, name: str) -> APIError:
        return APIError(404, f"The model `{name}` does not exist. Available: "
                             f"{', '.join(self.names())}", param="model")

    def _card(self, name: str, root: str | None = None,
              parent: str | None = None) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": "hitchllm",
                "root": root or name, "parent": parent,
                "max_model_len": self.engine.max_model_len}

    # ---- run-time loading --------------------------------------------------------------

    def _check_runtime_updating(self) -> None:
        if not self.engine.config.enable_lora:
            raise APIError(400, "this server runs without LoRA; start it with --enable-lora "
                                f"(needs the {LORA_PLUGIN} plugin) to load adapters")
        if not self.allow_runtime_lora_updating:
            raise APIError(404, "loading and unloading LoRA adapters at run time is off; "
                                "start the server with HITCHLLM_ALLOW_RUNTIME_LORA_UPDATING=1 "
                                "to allow it, or name adapters with --lora-modules")

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        """Load the adapter at ``req.lora_path`` as model ``req.lora_name``; ``APIError`` 400
        when the name is taken or the directory is not an adapter this server can serve."""
        self._check_runtime_updating()
        name = req.lora_name
        if name in self.base_names:
            raise APIError(400, f"`{name}` is the base model's name; give the adapter another "
                                "lora_name", param="lora_name")
        adapters = self.adapters()
        if any(a.lora_name == name for a in adapters):
            raise APIError(400, f"The LoRA adapter `{name}` is already loaded; unload it "
                                "first or give this adapter another lora_name",
                           param="lora_name")
        lora_id = max((a.lora_int_id for a in adapters), default=0) + 1
        try:
            # Reading the directory takes a while; the engine loop keeps serving meanwhile.
            await asyncio.to_thread(self.engine.add_lora,
                                    LoRARequest(name, lora_id, req.lora_path))
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path") from exc
        logger.info("loaded LoRA adapter %r from %s through /v1/load_lora_adapter",
                    name, req.lora_path)
        return f"Success: LoRA adapter `{name}` added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        """Unload adapter ``req.lora_name`` (requests already running finish with it);
        ``APIError`` 404 listing the loaded adapters when there is none of that name."""
        self._check_runtime_updating()
        try:
            await asyncio.to_thread(self.engine.remove_lora, req.lora_name)
        except ValueError as exc:
            raise APIError(404, str(exc), param="lora_name") from exc
        logger.info("unloaded LoRA adapter %r through /v1/unload_lora_adapter", req.lora_name)
        return f"Success: LoRA adapter `{req.lora_name}` removed successfully."
