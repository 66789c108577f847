"""The host-side adapter cache: adapters known by name, and up to ``max_cpu_loras`` of them
read into host memory, least recently used evicted first.

An adapter's identity is one load of it: ``(lora_name, lora_path, load_id)``. A name is bound
to one path while it is known (a request naming it with another path is refused), and each
load gets a new ``load_id``, so unloading a name and loading it again (from another directory,
or from the same one rewritten in place) never mixes the two in a device slot or in the
prefix cache. Requests already accepted
keep their own ``LoRARequest``, so an adapter evicted from host memory (or unloaded) while
they wait is read again from its directory when they run.

Thread-safe: a server may load adapters from another thread than the engine loop's.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from hitchllm.lora import LoRARequest
from hitchllm_lora.adapter import LoRAAdapter

logger = logging.getLogger("hitchllm.lora")

AdapterKey = tuple[str, str, int]


@dataclass(frozen=True, eq=False)
class LoadedLoRARequest(LoRARequest):
    """A ``LoRARequest`` bound to one load of its adapter (what requests carry once
    accepted); ``load_id`` tells two loads of the same name and directory apart. It equals
    any ``LoRARequest`` with the same vLLM fields, so callers may compare what ``add_lora``
    returns with what they passed; the plugin tells loads apart by ``adapter_key`` alone."""

    load_id: int = 0

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LoRARequest):
            return NotImplemented
        return _fields(self) == _fields(other)

    def __hash__(self) -> int:
        return hash(_fields(self))


def _fields(request: LoRARequest) -> tuple[str, int, str]:
    return request.lora_name, request.lora_int_id, request.lora_path


def adapter_key(request: LoRARequest | None) -> AdapterKey | None:
    """The identity of the adapter a request runs with (None: the base model)."""
    if request is None:
        return None
    return (request.lora_name, request.lora_path, getattr(request, "load_id", 0))


class AdapterCache:
    """Known adapters by name, and an LRU of adapters read into host memory."""

    def __init__(self, capacity: int, read: Callable[[LoRARequest], LoRAAdapter]) -> None:
        self.capacity = capacity
        self._read = read
        self._known: dict[str, LoadedLoRARequest] = {}
        self._loaded: OrderedDict[AdapterKey, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self._load_ids = itertools.count(1)
        self.num_reads = 0
        self.num_evictions = 0

    def names(self) -> list[str]:
        """The names of the known adapters, in the order they became known."""
        with self._lock:
            return list(self._known)

    def known(self) -> list[LoRARequest]:
        """The known adapters, in the order they became known."""
        with self._lock:
            return list(self._known.values())

    def resolve(self, request: LoRARequest) -> LoRARequest:
        """Check ``request``'s fields and bind it to the known adapter of its name (an empty
        ``lora_path`` refers to it), or to a new load of its directory; ``ValueError`` when
        it cannot name one adapter."""
        return self._bind(request)[0]

    def _bind(self, request: LoRARequest) -> tuple[LoadedLoRARequest, bool]:
        """``resolve``, and whether the binding is to an adapter known when looked up."""
        if not isinstance(request, LoRARequest):
            raise ValueError(f"lora_request must be a hitchllm.LoRARequest, got "
                             f"{type(request).__name__}")
        if not isinstance(request.lora_name, str) or not request.lora_name:
            raise ValueError("LoRARequest.lora_name must be a non-empty string")
        if (not isinstance(request.lora_int_id, int) or isinstance(request.lora_int_id, bool)
                or request.lora_int_id < 1):
            raise ValueError(f"LoRARequest.lora_int_id must be a positive integer, got "
                             f"{request.lora_int_id!r}")
        with self._lock:
            known = self._known.get(request.lora_name)
        if known is not None:
            if request.lora_path not in ("", known.lora_path):
                raise ValueError(
                    f"LoRA adapter {request.lora_name!r} is loaded from {known.lora_path}, not "
                    f"{request.lora_path}; unload it first or give this adapter another name")
            return known, True
        if not request.lora_path:
            raise ValueError(f"LoRA adapter {request.lora_name!r} is not loaded and the request "
                             f"gives no lora_path; known adapters: {self.names() or 'none'}")
        return LoadedLoRARequest(request.lora_name, request.lora_int_id, request.lora_path,
                                 next(self._load_ids)), False

    def add(self, request: LoRARequest) -> LoRARequest:
        """Make the adapter known: read and check its directory and keep it in host memory;
        returns the request bound to it. An adapter already known is not read again (it was
        checked when it became known; ``get`` reads it when a slot needs it and it has left
        host memory), as requests are added on the engine's thread; it only becomes the most
        recently used. ``ValueError`` for a bad request or directory; nothing changes
        then."""
        resolved, was_known = self._bind(request)
        if was_known:
            with self._lock:
                if self._known.get(resolved.lora_name) is resolved:
                    if adapter_key(resolved) in self._loaded:
                        self._loaded.move_to_end(adapter_key(resolved))
                    return resolved
            # Unloaded since it was looked up: the unload stands (a request naming the
            # adapter alone is refused now; one with its directory loads it anew).
            return self.add(request)
        self.get(resolved)
        with self._lock:
            known = self._known.setdefault(resolved.lora_name, resolved)
        if known is not resolved and known.lora_path != resolved.lora_path:
            # Another thread bound the name to another directory meanwhile.
            return self.resolve(request)
        return known

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` and free its host memory; ``ValueError`` if unknown."""
        with self._lock:
            known = self._known.pop(name, None)
            if known is None:
                raise ValueError(f"LoRA adapter {name!r} is not loaded; loaded: "
                                 f"{list(self._known) or 'none'}")
            self._loaded.pop(adapter_key(known), None)
        logger.info("unloaded LoRA adapter %r (%s)", name, known.lora_path)

    def get(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter in host memory, read from its directory if it is not (evicting the
        least recently used beyond capacity)."""
        key = adapter_key(request)
        with self._lock:
            adapter = self._loaded.get(key)
            if adapter is not None:
                self._loaded.move_to_end(key)
                return adapter
        adapter = self._read(request)  # outside the lock: it reads files
        with self._lock:
            self.num_reads += 1
            self._loaded[key] = adapter
            self._loaded.move_to_end(key)
            evicted = []
            while len(self._loaded) > self.capacity:
                evicted.append(self._loaded.popitem(last=False)[0])
            self.num_evictions += len(evicted)
        logger.info("loaded LoRA adapter %r (rank %d, %d modules, %.1f MiB) from %s",
                    request.lora_name, adapter.rank, len(adapter.weights),
                    adapter.num_bytes / 2**20, request.lora_path)
        for name, path, _ in evicted:
            logger.info("evicted LoRA adapter %r (%s) from host memory (max_cpu_loras=%d)",
                        name, path, self.capacity)
        return adapter

    def is_loaded(self, request: LoRARequest) -> bool:
        """Whether the adapter is in host memory now."""
        with self._lock:
            return adapter_key(request) in self._loaded
