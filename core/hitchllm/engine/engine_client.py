"""``EngineClient``: what the OpenAI server needs from the engine(s) it serves.

Two implementations: ``AsyncLLMEngine`` (one engine, stepping in a thread of the server's
process) and ``hitchllm.data_parallel.DataParallelEngine`` (N engine replicas, each in its own
process, behind a load balancer). The server, its routes and ``ServedModels`` use only what
is listed here, so either serves the same API.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hitchllm.config import EngineConfig
    from hitchllm.lora import LoRARequest
    from hitchllm.outputs import RequestOutput
    from hitchllm.sampling_params import SamplingParams


class EngineClient(Protocol):
    """Generation, aborts, health and LoRA adapters of the engine(s) behind a server."""

    # The engine arguments (every replica runs with the same ones).
    config: EngineConfig
    # The longest prompt plus output a request may have.
    max_model_len: int

    @property
    def dead_reason(self) -> str | None:
        """None while healthy; else why not (served as ``/health``'s 503, without internal
        detail)."""

    def generate(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's output each time it makes progress, the last one finished.

        Raises ``ValueError`` (before yielding) for a request the engine rejects,
        ``RequestFailedError`` when the engine fails it, ``EngineDeadError`` when the engine
        that runs it stopped. A caller that stops iterating early aborts the request.
        ``kwargs`` are ``LLMEngine.add_request``'s (``lora_request``, ``priority``, ...).
        """

    def abort(self, request_id: str) -> None:
        """Stop the request; its stream ends with a finished output (finish_reason
        "abort")."""

    def add_lora(self, lora_request: LoRARequest) -> LoRARequest:
        """Load an adapter (blocking: call it from a worker thread); ``ValueError`` says what
        is wrong with it."""

    def remove_lora(self, lora_name: str) -> None:
        """Unload an adapter (blocking); ``ValueError`` if none has that name."""

    def list_loras(self) -> list[LoRARequest]:
        """The loaded adapters, oldest first."""

    def shutdown(self) -> None:
        """Stop the engine(s) and release what they hold (threads, processes)."""
