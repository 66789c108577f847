"""What the server and a replica process send each other over their pipe (pickled).

Server -> replica: ``Generate``, ``Abort``, ``Call``, and ``None`` to shut down.
Replica -> server: ``Ready`` or ``StartFailed`` once, then ``Deliveries`` (request outputs as
deltas and per-request errors, all those of one engine step in one message), ``Reply`` to each
``Call``, and ``Dead`` if its engine loop stops.

Errors cross as ``WireError`` (a kind and a message), not as pickled exceptions, which may
not unpickle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hitchllm.lora import LoRARequest


@dataclass
class Generate:
    request_id: str
    prompt: Any
    params: Any  # SamplingParams
    kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Abort:
    request_id: str


@dataclass
class Call:
    """Run ``method`` (``add_lora``, ``remove_lora`` or ``metrics``) on the replica."""

    call_id: int
    method: str
    args: tuple[Any, ...] = ()


@dataclass
class Ready:
    pid: int
    max_model_len: int
    loras: list[LoRARequest]
    # The replica's device, and on CUDA the UUIDs of the GPUs it sees.
    device: str = "cpu"
    gpus: list[str] = field(default_factory=list)


@dataclass
class WireError:
    """An exception, by kind: ``invalid`` (ValueError), ``type`` (TypeError), ``failed``
    (the engine failed the request), ``dead`` (the engine loop stopped), ``internal``."""

    kind: str
    message: str

    @staticmethod
    def of(exc: BaseException) -> WireError:
        from hitchllm.engine.async_engine import EngineDeadError, RequestFailedError

        if isinstance(exc, ValueError):
            return WireError("invalid", str(exc))
        if isinstance(exc, TypeError):
            return WireError("type", str(exc))
        if isinstance(exc, RequestFailedError):
            return WireError("failed", str(exc))
        if isinstance(exc, EngineDeadError):
            return WireError("dead", str(exc))
        return WireError("internal", type(exc).__name__)


@dataclass
class StartFailed:
    error: WireError


@dataclass
class Deliveries:
    """``(request_id, OutputDelta or GrowDelta, WireError or None)`` in the order they
    happened; None ends a request the server aborted."""

    items: list[tuple[str, Any]]


@dataclass
class Reply:
    call_id: int
    value: Any = None
    error: WireError | None = None


@dataclass
class Dead:
    reason: str
